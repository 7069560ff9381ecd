"""The quantizers: round-to-nearest with clipping search and GPTQ, against numpy float64
references (an exact grid, MLX's own min-max rounding, a textbook sequential GPTQ). The
calibrated-beats-RTN property on the real models is in test_quant_storage.py."""

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.errors import QuantizationError
from mlxspec.quant import gptq, rtn, zp_format


def dense(q, scales, zeros, group_size) -> np.ndarray:
    """w = s * (q - z) in float64."""
    s = np.repeat(scales.astype(np.float64), group_size, axis=1)
    return s * (q.astype(np.float64) - np.repeat(zeros.astype(np.float64), group_size, axis=1))


def correlated_inputs(rng, rows: int, features: int) -> np.ndarray:
    """Activations with correlated features and a few large ones, like a transformer's."""
    mix = rng.standard_normal((features, features)) * 0.3 + np.eye(features)
    x = rng.standard_normal((rows, features)) @ mix
    x[:, : features // 16] *= 8
    return x.astype(np.float32)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rtn_recovers_weights_that_lie_exactly_on_a_grid(bits, group_size, dtype):
    # Every group spans its full integer range with an exact scale of the dtype, so min-max finds
    # the very same s and z and the reconstruction is exact.
    rng = np.random.default_rng(bits)
    out_features, in_features, qmax = 16, 128, 2**bits - 1
    q = rng.integers(0, qmax + 1, (out_features, in_features))
    q[:, ::group_size], q[:, 1::group_size] = 0, qmax
    zeros = rng.integers(0, qmax + 1, (out_features, in_features // group_size))
    scales = zp_format.round_scales(rng.random(zeros.shape) * 0.05 + 0.001, bits, dtype)
    w = dense(q, scales, zeros, group_size).astype(np.float32)
    q2, s2, z2 = rtn.quantize(w, bits, group_size, dtype=dtype)
    np.testing.assert_array_equal(dense(q2, s2, z2, group_size), w.astype(np.float64))
    assert q2.dtype == np.uint8 and z2.dtype == np.uint8
    assert zp_format.scales_are_exact(mx.array(s2).astype(getattr(mx, dtype)), bits)


def mlx_minmax(w: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """MLX's own affine min-max quantization and back (float32 scale and bias)."""
    wq, scales, biases = mx.quantize(mx.array(w), group_size=group_size, bits=bits)
    return np.array(mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits), np.float64)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_rtn_default_is_mlx_min_max_with_integer_zero_points(bits):
    # Groups of both signs (as real weights): MLX makes the larger-magnitude end exact and zero
    # an integer step; so does mlxspec, with scales exact in float32 (24 - bits significant bits).
    rng = np.random.default_rng(0)
    w = (rng.standard_t(4, (64, 256)) * 0.02).astype(np.float32)
    ours = dense(*rtn.quantize(w, bits, 64, dtype="float32"), 64)
    step = (w.reshape(64, -1, 64).max(-1) - w.reshape(64, -1, 64).min(-1)) / (2**bits - 1)
    # (both differ by the last bits of the scale, times q: up to 2**bits * 2**(bits - 24) steps)
    close = np.abs(ours - mlx_minmax(w, bits, 64)) <= 2.0 ** (2 * bits - 22) * np.repeat(step, 64, 1)
    assert close.mean() > 0.99  # the rest: ties of round(w / s) moved by the scale's last bit


@pytest.mark.parametrize("bits", [3, 4])
def test_rtn_clipping_search_only_lowers_the_squared_error(bits):
    rng = np.random.default_rng(0)
    w = (rng.standard_t(4, (64, 256)) * 0.02).astype(np.float32)  # heavy tails: clipping helps
    plain = dense(*rtn.quantize(w, bits, 64, grid=1), 64)
    searched = dense(*rtn.quantize(w, bits, 64, grid=10), 64)
    group_err = lambda d: ((d - w) ** 2).reshape(64, -1, 64).sum(-1)  # noqa: E731
    assert np.all(group_err(searched) <= group_err(plain) + 1e-12)
    assert group_err(searched).sum() < 0.97 * group_err(plain).sum()


def test_rtn_importance_weighting_lowers_the_weighted_error():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((32, 128)) * 0.02).astype(np.float32)
    importance = np.where(np.arange(128) % 8 == 0, 100.0, 1.0).astype(np.float32)
    weighted = lambda d: (((d - w) ** 2) * importance).sum()  # noqa: E731
    plain = dense(*rtn.quantize(w, 4, 32, grid=10), 32)
    aware = dense(*rtn.quantize(w, 4, 32, importance=importance, grid=10), 32)
    assert weighted(aware) < weighted(plain)


def test_rtn_handles_all_zero_and_constant_groups():
    w = np.zeros((4, 64), np.float32)
    w[1] = 0.5
    w[2, :32] = -3e-7  # below float16's smallest normal
    q, s, z = rtn.quantize(w, 4, 32)
    # Every weight within half a step (its scale is an exact float16 affine scale: at least
    # float16's smallest normal, 7 significant bits), and no scale is 0.
    step = np.repeat(s.astype(np.float64), 32, axis=1)
    assert np.all(np.abs(dense(q, s, z, 32) - w) <= step / 2)
    assert np.all(s >= 2.0**-14)


def test_rtn_rejects_a_group_size_that_does_not_divide_the_row():
    with pytest.raises(QuantizationError, match="not a multiple of group size 128"):
        rtn.quantize(np.zeros((4, 576), np.float32), 4, 128)


def sequential_gptq_reference(w, h, bits, group_size, damp):
    """GPTQ as the paper's Algorithm 1 without the Cholesky reformulation: after rounding column
    i, update the later columns with the inverse Hessian, then remove i from the inverse
    (Gaussian elimination), all in float64."""
    w = w.astype(np.float64).copy()
    n = w.shape[1]
    h = h + damp * np.mean(np.diag(h)) * np.eye(n)
    hinv = np.linalg.inv(h)
    q = np.zeros(w.shape)
    for i in range(n):
        if i % group_size == 0:
            s, z = rtn.find_params(w[:, i : i + group_size].astype(np.float32), bits)
            s, z = s.astype(np.float64), z.astype(np.float64)
        q[:, i] = np.clip(np.rint(w[:, i] / s) + z, 0, 2**bits - 1)
        err = (w[:, i] - s * (q[:, i] - z)) / hinv[i, i]
        w[:, i + 1 :] -= np.outer(err, hinv[i, i + 1 :])
        hinv = hinv - np.outer(hinv[:, i], hinv[i, :]) / hinv[i, i]
    return q


def test_gptq_matches_a_sequential_float64_reference():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((24, 256)) * 0.02).astype(np.float32)
    x = correlated_inputs(rng, 2048, 256)
    h = x.astype(np.float64).T @ x / len(x)
    q, _, _, perm = gptq.quantize(w, h, 4, 64, damp=0.01)
    assert perm is None
    reference = sequential_gptq_reference(w, h, 4, 64, 0.01)
    # float32 vs float64 arithmetic may flip a rounding decision near .5; the rest must agree.
    assert np.mean(q == reference) > 0.99


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_beats_rtn_on_correlated_inputs(act_order):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((128, 256)) * 0.02).astype(np.float32)
    x = correlated_inputs(rng, 4096, 256)
    gptq_h = gptq.Hessian(256)
    gptq_h.add(mx.array(x[:2048]))
    gptq_h.add(mx.array(x[2048:]))
    np.testing.assert_allclose(gptq_h.matrix(), x.astype(np.float64).T @ x / 4096, rtol=1e-4,
                               atol=1e-3)
    reference = x.astype(np.float64) @ w.T.astype(np.float64)

    def output_error(weights, perm=None):
        inputs = x if perm is None else x[:, perm]
        return np.mean((inputs.astype(np.float64) @ weights.T - reference) ** 2)

    rtn_error = output_error(dense(*rtn.quantize(w, 4, 64), 64))
    q, s, z, perm = gptq.quantize(w, gptq_h.matrix(), 4, 64, act_order=act_order)
    assert (perm is not None) == act_order
    if act_order:
        assert sorted(perm.tolist()) == list(range(256))
        assert list(perm[:16]) != list(range(16))  # the big features come first
    assert output_error(dense(q, s, z, 64), perm) < 0.6 * rtn_error


def test_gptq_static_groups_take_act_order_without_a_permutation():
    # AutoGPTQ's static groups: every group's scale and zero-point are min-max of the original
    # weights (round-to-nearest's), chosen before any column moves, so act-order's result is
    # stored in the natural column order, and still beats round-to-nearest's output error.
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((128, 256)) * 0.02).astype(np.float32)
    x = correlated_inputs(rng, 4096, 256)
    h = x.astype(np.float64).T @ x / len(x)
    reference = x.astype(np.float64) @ w.T.astype(np.float64)
    rtn_q, rtn_s, rtn_z = rtn.quantize(w, 4, 64)
    q, s, z, perm = gptq.quantize(w, h, 4, 64, act_order=True, static_groups=True)
    assert perm is None
    np.testing.assert_array_equal(s, rtn_s)
    np.testing.assert_array_equal(z, rtn_z)
    assert np.mean(q != rtn_q) > 0.05  # GPTQ moved roundings, within the fixed groups

    def output_error(weights):
        return np.mean((x.astype(np.float64) @ weights.T - reference) ** 2)

    assert output_error(dense(q, s, z, 64)) < 0.6 * output_error(dense(rtn_q, rtn_s, rtn_z, 64))


def test_gptq_zeroes_dead_inputs_and_survives_a_rank_deficient_hessian():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((16, 64)) * 0.02).astype(np.float32)
    x = rng.standard_normal((8, 64)).astype(np.float32)  # 8 rows: rank 8 of 64
    x[:, 5] = 0
    h = x.astype(np.float64).T @ x / 8
    q, s, z, _ = gptq.quantize(w, h, 4, 32)
    d = dense(q, s, z, 32)
    assert np.all(np.isfinite(d))
    assert np.abs(d[:, 5]).max() <= np.abs(s).max() / 2 + 1e-6  # ~0: the weight cannot matter


def test_sensitivity_recipe_promotes_within_the_budget_and_restores_the_model(tmp_path):
    from tiny_models import make_tiny_model

    from mlxspec.load import load
    from mlxspec.quant import zp_format
    from mlxspec.quant.layers import is_quantized
    from mlxspec.quant.mixed import plan_layers, sensitivity_recipe
    from mlxspec.quant.quantize import quantize_model

    model, _ = load(str(make_tiny_model(tmp_path / "tiny")))
    tokens = [list(range(i, i + 48)) for i in range(0, 96, 48)]
    before = np.array(model(mx.array(tokens)))
    recipe = sensitivity_recipe(model, tokens, bits=4, group_size=32, target_bpw=5.0)
    assert not is_quantized(model)
    np.testing.assert_array_equal(np.array(model(mx.array(tokens))), before)
    sensitivity = recipe["sensitivity"]
    assert set(sensitivity) == {"model.embed_tokens"} | {
        f"model.layers.*.{name}" for name in ("self_attn.q_proj", "self_attn.k_proj",
                                              "self_attn.v_proj", "self_attn.o_proj",
                                              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }
    assert all(v >= 0 for v in sensitivity.values()) and max(sensitivity.values()) > 0
    assert recipe["rules"] and all(rule["bits"] == 8 for rule in recipe["rules"])
    plan = plan_layers(model, 4, 32, recipe=recipe)
    sizes = {p: m.weight.size for p, m in model.named_modules() if p in plan}
    stored = sum(sizes[p] * zp_format.bits_per_weight(s.bits, s.group_size) for p, s in plan.items())
    assert stored / sum(sizes.values()) <= 5.0
    _, record = quantize_model(model, bits=4, group_size=32, recipe=recipe)
    assert record["recipe"] == "sensitivity:5" and record["layers"]


# -- AWQ -----------------------------------------------------------------------------------------


def test_awq_scales_cut_the_output_error_when_a_few_inputs_dominate():
    """Inputs with a few 20x channels (as in LLM activations): scaling those channels' weights up
    before rounding lowers the output error against plain min-max RTN, and alpha = 0 (no
    scaling) is on the grid, so the search can never do worse."""
    from mlxspec.quant import awq

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2048, 128)).astype(np.float32)
    x[:, [3, 40, 77]] *= 20
    h = x.astype(np.float64).T @ x / len(x)
    weights = [rng.standard_normal((96, 128)).astype(np.float32) for _ in range(2)]
    s, alpha, ratio = awq.search_scales(weights, h, 4, 32)
    assert s.shape == (128,) and np.all(s > 0) and alpha > 0
    assert ratio < 0.8
    # the reported ratio is the float64 output error on the calibration rows themselves
    def error(w, w_hat):
        return np.mean(np.sum((x.astype(np.float64) @ (w - w_hat).T) ** 2, axis=1))

    with_s = sum(error(w, awq._dequantized(w * s, 4, 32, "float16") / s) for w in weights)
    without = sum(error(w, awq._dequantized(w, 4, 32, "float16")) for w in weights)
    np.testing.assert_allclose(with_s / without, ratio, rtol=1e-3)
    flat = np.eye(128)  # no dominant inputs: nothing to gain, and no loss either
    assert awq.search_scales(weights, flat, 4, 32)[2] <= 1.0
    # The final quantizer agrees that the searched scales help; wild scales do not.
    assert awq.scaling_helps(weights, h, s, 4, 32)
    wild = rng.uniform(0.05, 20.0, 128).astype(np.float32)
    assert not awq.scaling_helps(weights, flat, wild, 4, 32)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_awq_folding_leaves_the_float_block_unchanged(arch):
    """Norm weights divided by s (Gemma's ``1 + w`` norms too), up_proj rows divided by s, the
    next linears' columns multiplied by s: the float block computes the same function."""
    import importlib

    from mlxspec.quant import awq

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = module.ModelArgs.from_dict({
        "model_type": arch, "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "vocab_size": 64, "head_dim": 16, "rope_theta": 10000.0, "sliding_window": 8,
        "query_pre_attn_scalar": 16,
    })
    mx.random.seed(0)
    block = module.Model(args).layers[0]
    for norm in awq_norms(block):  # random norm weights: folding must handle any values
        norm.weight = mx.random.uniform(0.5, 1.5, norm.weight.shape)
    x = mx.random.normal((2, 12, 64)) * 3
    before = block(x, None, None)
    rng = np.random.default_rng(1)
    s_attn, s_mlp, s_down = (rng.uniform(0.3, 3.0, n).astype(np.float32) for n in (64, 64, 96))
    mlp_norm = getattr(block, "pre_feedforward_layernorm", None) or block.post_attention_layernorm
    assert awq.norm_offset(block.input_layernorm) == (1.0 if arch == "gemma3_text" else 0.0)
    awq.fold_into_norm(block.input_layernorm, s_attn)
    for linear in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj):
        awq.scale_columns(linear, s_attn)
    awq.fold_into_norm(mlp_norm, s_mlp)
    awq.scale_columns(block.mlp.gate_proj, s_mlp)
    awq.scale_columns(block.mlp.up_proj, s_mlp)
    awq.fold_into_rows(block.mlp.up_proj, s_down)
    awq.scale_columns(block.mlp.down_proj, s_down)
    after = block(x, None, None)
    np.testing.assert_allclose(np.array(after), np.array(before), rtol=1e-4, atol=1e-4)


def awq_norms(block):
    return [m for name, m in block.named_modules() if name.endswith("norm")]


@pytest.mark.parametrize("method", ["awq", "awq+gptq"])
def test_awq_quantizes_a_tiny_model_close_to_its_float_outputs(tmp_path, method):
    from tiny_models import make_tiny_model

    from mlxspec.load import load
    from mlxspec.quant.layers import ZeroPointLinear
    from mlxspec.quant.quantize import quantize_model

    model, _ = load(str(make_tiny_model(tmp_path / "tiny")))
    tokens = mx.array([list(range(i, i + 48)) for i in range(0, 192, 48)])
    reference = model(tokens)
    _, record = quantize_model(model, bits=8, group_size=32, method=method,
                               calibration_tokens=tokens.tolist())
    assert record["method"] == method
    assert all(isinstance(m, ZeroPointLinear) for p, m in model.named_modules()
               if p.endswith(("q_proj", "o_proj", "down_proj")))
    got = model(tokens)
    rel = float(mx.linalg.norm(got - reference) / mx.linalg.norm(reference))
    assert rel < 0.02, rel


def _outlier_tiny_model(source):
    """The tiny model with 4 of 64 channels of every pre-attention and pre-MLP norm at 10x: the
    few dominant input channels real models have and AWQ is for."""
    from mlxspec.load import load

    model, _ = load(str(source))
    rng = np.random.default_rng(0)
    for layer in model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            weight = np.ones(64, np.float32)
            weight[rng.choice(64, 4, replace=False)] = 10.0
            norm.weight = mx.array(weight)
    return model


def test_awq_with_gptq_rounding_beats_awq_and_gptq_on_dominant_channels(tmp_path):
    """awq+gptq keeps AWQ's scales and lets GPTQ choose the roundings: on the text it calibrated
    on, its logits are clearly closer to the float model's than either method alone (measured:
    relative error 0.49 against AWQ 0.56 and GPTQ 0.55 at 3 bits)."""
    from tiny_models import make_tiny_model

    from mlxspec.quant.quantize import quantize_model

    source = make_tiny_model(tmp_path / "tiny")
    tokens = mx.array([list(range(i, i + 48)) for i in range(0, 192, 48)])
    expected = _outlier_tiny_model(source)(tokens)
    errors = {}
    for method in ("awq", "gptq", "awq+gptq"):
        model = _outlier_tiny_model(source)
        quantize_model(model, bits=3, group_size=32, method=method,
                       calibration_tokens=tokens.tolist())
        errors[method] = float(mx.linalg.norm(model(tokens) - expected)
                               / mx.linalg.norm(expected))
    assert errors["awq+gptq"] < 0.95 * min(errors["awq"], errors["gptq"]), errors


def test_awq_with_gptq_rounding_gives_gptq_the_hessian_of_the_scaled_inputs(tmp_path, monkeypatch):
    """After folding ``1 / s`` into the norm, q/k/v read ``x / s`` and hold ``W * s``: GPTQ must
    see ``H / (s s.T)`` so that its objective is the layer's true output error. Checked against
    an independent recomputation: ``W' H' W'.T`` must equal ``W X.T X W.T / rows`` from the float
    model's own activations (the float outputs' second moment, which scaling cannot change)."""
    from tiny_models import make_tiny_model

    from mlxspec.quant import gptq
    from mlxspec.quant.quantize import quantize_model

    source = make_tiny_model(tmp_path / "tiny")
    tokens = mx.array([list(range(i, i + 48)) for i in range(0, 192, 48)])
    reference = _outlier_tiny_model(source)
    block = reference.layers[0]
    x = block.input_layernorm(reference.model.embed_tokens(tokens)).reshape(-1, 64)
    x = np.array(x, np.float64)
    calls = []
    original = gptq.quantize
    monkeypatch.setattr(gptq, "quantize", lambda w, h, *a, **k: (
        calls.append((np.array(w, np.float64), np.array(h, np.float64))) or original(w, h, *a, **k)))
    quantize_model(_outlier_tiny_model(source), bits=4, group_size=32, method="awq+gptq",
                   calibration_tokens=tokens.tolist())
    attention = block.self_attn
    for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
        w = np.array(linear.weight, np.float64)
        # this linear's call: block 0's calls come first; its weight is w with scaled columns
        (w_scaled, h_scaled), = [
            (ws, hs) for ws, hs in calls[:7]
            if ws.shape == w.shape and np.allclose(ws / w, (ws / w)[:1], rtol=1e-4)
        ]
        assert not np.allclose(w_scaled, w, rtol=1e-3)  # AWQ did scale these columns
        expected = w @ (x.T @ x / len(x)) @ w.T
        np.testing.assert_allclose(w_scaled @ h_scaled @ w_scaled.T, expected,
                                   rtol=1e-3, atol=1e-3 * np.abs(expected).max())


def test_awq_gptq_gives_plain_gptq_to_blocks_whose_scales_cannot_be_folded(tmp_path, monkeypatch):
    """awq+gptq is the default method, so an architecture AWQ cannot rescale must not stop it:
    such a block is restored (its norms were already divided by s here) and quantized exactly as
    ``--method gptq`` would, and the record names it."""
    from mlx.utils import tree_flatten
    from tiny_models import make_tiny_model

    from mlxspec.load import load
    from mlxspec.quant import awq
    from mlxspec.quant.quantize import HEAD_DAMP, quantize_model

    source = make_tiny_model(tmp_path / "tiny")
    tokens = [list(range(i, i + 48)) for i in range(0, 192, 48)]
    expected, _ = load(str(source))
    quantize_model(expected, bits=4, group_size=32, method="gptq", calibration_tokens=tokens,
                   head_damp=HEAD_DAMP["awq+gptq"])  # the blocks as gptq's; awq+gptq's head
    monkeypatch.setattr(awq, "scale_columns", lambda linear, s: None)  # fold without compensating
    model, _ = load(str(source))
    _, record = quantize_model(model, bits=4, group_size=32, method="awq+gptq",
                               calibration_tokens=tokens)
    assert record["awq_unscaled_blocks"] == ["model.layers.0", "model.layers.1"]
    got, want = dict(tree_flatten(model.parameters())), dict(tree_flatten(expected.parameters()))
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert mx.array_equal(got[name], value).item(), name


def test_awq_refuses_a_block_whose_inputs_it_cannot_rescale(tmp_path, monkeypatch):
    """If folding would change the float function (here: the scales are not compensated), the
    method stops with a one-line error instead of writing a silently wrong model."""
    from tiny_models import make_tiny_model

    from mlxspec.load import load
    from mlxspec.quant import awq
    from mlxspec.quant.quantize import quantize_model

    model, _ = load(str(make_tiny_model(tmp_path / "tiny")))
    monkeypatch.setattr(awq, "scale_columns", lambda linear, s: None)  # fold without compensating
    tokens = [list(range(i, i + 48)) for i in range(0, 192, 48)]
    with pytest.raises(QuantizationError, match="use --method gptq"):
        quantize_model(model, bits=4, group_size=32, method="awq", calibration_tokens=tokens)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_embedding_tables_get_the_clipping_search_whatever_the_method(tmp_path, method):
    """An embedding table no method calibrates (its rows are used as stored; a tied table is
    GPTQ's output head unless ``head_damp=None``) gets the clipping search on its own squared
    error by default; an explicit ``grid`` applies to it too."""
    from tiny_models import make_tiny_model

    from mlxspec.load import load
    from mlxspec.quant import layers
    from mlxspec.quant.quantize import EMBEDDING_GRID, quantize_model

    source = make_tiny_model(tmp_path / "tiny")
    tokens = [list(range(i, i + 32)) for i in range(0, 128, 32)]
    for grid, expected_grid in ((None, EMBEDDING_GRID), (1, 1)):
        model, _ = load(str(source))
        weight = np.array(model.model.embed_tokens.weight)
        quantize_model(model, bits=4, group_size=32, method=method, grid=grid,
                       calibration_tokens=tokens, head_damp=None)
        table = layers.zero_point_modules(model)["model.embed_tokens"]
        q = zp_format.unpack(np.array(table.weight), 4, table.in_features)
        z = zp_format.unpack(np.array(table.zeros), 4, table.in_features // 32)
        got = dense(q, np.array(table.scales.astype(mx.float32)), z, 32)
        want = dense(*rtn.quantize(weight, 4, 32, grid=expected_grid, dtype="float32"), 32)
        np.testing.assert_array_equal(got, want)
    clipped = dense(*rtn.quantize(weight, 4, 32, grid=EMBEDDING_GRID, dtype="float32"), 32)
    plain = dense(*rtn.quantize(weight, 4, 32, grid=1, dtype="float32"), 32)
    assert np.sum((clipped - weight) ** 2) < np.sum((plain - weight) ** 2)


def test_gptq_head_is_gptq_on_the_final_norms_outputs_and_lowers_the_head_error(tmp_path):
    """With ``head_damp`` an untied output head is GPTQ-quantized with the Hessian of the final
    norm's outputs (the blocks already quantized): the same integers as GPTQ given that Hessian
    computed independently (mlx-lm's ``model.model`` returns the normed hidden states), a smaller
    output error on those states than round-to-nearest, and the record names the candidate with
    the smaller KL on the check windows."""
    import mlx.nn as nn
    from tiny_models import make_tiny_model

    from mlxspec.load import load
    from mlxspec.quant import layers
    from mlxspec.quant.awq import output_error
    from mlxspec.quant.quantize import quantize_model

    source = make_tiny_model(tmp_path / "tiny")
    # The GPTQ candidate is judged on 2 windows after being fitted on the others; so that it
    # wins on text it did not fit, the head's inputs have a few dominant channels (as a real
    # model's do), which GPTQ's rounding accounts for and round-to-nearest does not.
    tokens = np.random.default_rng(1).integers(0, 256, (16, 48)).tolist()
    heads = {}
    for head_damp in (None, 0.01):
        model, _ = load(str(source))
        vocab, hidden = model.model.embed_tokens.weight.shape  # an untied head of its own
        model.args.tie_word_embeddings = False
        model.lm_head = nn.Linear(hidden, vocab, bias=False)
        model.lm_head.weight = mx.array(np.random.default_rng(0).standard_normal(
            (vocab, hidden)).astype(np.float32) * 0.05)
        model.model.norm.weight = mx.array(np.where(np.arange(hidden) % 16 == 0, 8.0, 1.0)
                                           .astype(np.float32))
        weight, table = np.array(model.lm_head.weight), np.array(model.model.embed_tokens.weight)
        _, record = quantize_model(model, bits=4, group_size=32, method="gptq",
                                   calibration_tokens=tokens, head_damp=head_damp, dtype="float32")
        head = layers.zero_point_modules(model)["lm_head"]
        q = zp_format.unpack(np.array(head.weight), 4, head.in_features)
        z = zp_format.unpack(np.array(head.zeros), 4, head.in_features // 32)
        heads[head_damp] = (q, dense(q, np.array(head.scales.astype(mx.float32)), z, 32))
        assert ("head" in record) == (head_damp is not None)
    kl = record["head"]["calibration_kl"]
    assert record["head"]["method"] == "gptq" == min(kl, key=kl.get), record["head"]
    model.model.embed_tokens = nn.Embedding(*table.shape)  # the float table the blocks saw
    model.model.embed_tokens.weight = mx.array(table)
    x = np.concatenate([np.array(model.model(mx.array(tokens[i : i + 1])))[0]
                        for i in range(len(tokens))]).astype(np.float64)
    hessian = x.T @ x / len(x)
    want, _, _, _ = gptq.quantize(weight, hessian, 4, 32, damp=0.01, dtype="float32")
    assert np.mean(heads[0.01][0] == want) > 0.99  # float32 sums in another order may flip a few
    assert (output_error(weight, heads[0.01][1], hessian)
            < 0.9 * output_error(weight, heads[None][1], hessian))
