"""Distillation of the scales (:mod:`mlxspec.quant.distill`): it lowers the KL to the float model
on text it never saw, moves nothing but the scales, keeps them exact in the stored dtype, throws
away a result that is worse, and its output is an ordinary exact model that plain mlx-lm loads.

The KL references are float64 numpy recomputations from the two models' logits."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from click.testing import CliRunner
from tiny_models import make_tiny_model

from mlxspec.cli.main import cli
from mlxspec.errors import QuantizationError
from mlxspec.load import load
from mlxspec.quant import distill, layers, zp_format
from mlxspec.quant.calibrate import builtin_calibration_path, calibration_windows
from mlxspec.quant.quantize import quantize_model

TOKENS = 129  # per training window: the tiny model's byte tokenizer makes a token per byte


def kl64(teacher, student, windows) -> float:
    """Mean KL(teacher || student) per token, float64 numpy."""
    total, count = 0.0, 0
    for window in windows:
        ids = mx.array([window])
        p, q = (np.array(m(ids)[0].astype(mx.float32), np.float64) for m in (teacher, student))
        logp = p - p.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        logq = q - q.max(-1, keepdims=True)
        logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
        total += (np.exp(logp) * (logp - logq)).sum()
        count += len(window)
    return total / count


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    source = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny")
    teacher, tokenizer = load(str(source))
    train, _ = calibration_windows(tokenizer, builtin_calibration_path(), windows=12,
                                   window_tokens=TOKENS)
    # Held-out text: a part of the calibration file after the windows trained on.
    ids = tokenizer.encode(builtin_calibration_path().read_text(), add_special_tokens=False)
    held_out = [ids[i : i + 96] for i in range(40 * TOKENS, 48 * TOKENS, 96)]
    return source, teacher, tokenizer, train, held_out


def quantized(source, dtype: str, recipe=None):
    model, _ = load(str(source))
    quantize_model(model, bits=4, group_size=32, method="rtn", dtype=dtype, recipe=recipe)
    return model


def snapshot(model) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return {p: (np.array(m.weight), np.array(m.zeros), np.array(m.scales.astype(mx.float32)))
            for p, m in layers.zero_point_modules(model).items()}


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_distilled_scales_lower_held_out_kl_and_move_only_the_scales(tiny, dtype):
    source, teacher, _, train, held_out = tiny
    model = quantized(source, dtype, recipe="embed8")
    before, kl_before = snapshot(model), kl64(teacher, model, held_out)
    record = distill.distill_scales(model, teacher, train, dtype=dtype, epochs=8,
                                    learning_rate=1e-4)
    after, kl_after = snapshot(model), kl64(teacher, model, held_out)
    assert record["kept"] and record["kl_after"] < record["kl_before"], record
    assert kl_after < 0.8 * kl_before, (kl_after, kl_before)  # on text it was not trained on
    assert record["steps"] == (12 - distill.VALID_WINDOWS) * 8 // distill.BATCH_SIZE
    moved = 0
    for path, (weight, zeros, scales) in before.items():
        layer = layers.zero_point_modules(model)[path]
        np.testing.assert_array_equal(after[path][0], weight)  # q and z exactly as quantized
        np.testing.assert_array_equal(after[path][1], zeros)
        assert layer.scales.dtype == getattr(mx, dtype)
        assert zp_format.scales_are_exact(layer.scales, layer.bits), path
        if layer.bits == 8:  # the 8-bit embedding is not trained (as mlx-lm's DWQ)
            np.testing.assert_array_equal(after[path][2], scales)
        moved += not np.array_equal(after[path][2], scales)
    assert moved == len(before) - 1


def test_what_trains_computes_what_the_zero_point_model_computes(tiny):
    """The training twins (act-order GPTQ: a permutation; the tied head: the embedding) give the
    zero-point model's own logits, so the training optimizes the model that is stored (in
    float32 activations: a float16 model is trained as its float32 twin)."""
    source, _, _, train, held_out = tiny
    model, _ = load(str(source))
    quantize_model(model, bits=4, group_size=32, method="gptq", act_order=True, dtype="float32",
                   calibration_tokens=train[:4])
    ids = mx.array([held_out[0]])
    want = model(ids)
    zero_point = layers.zero_point_modules(model)
    assert any("perm" in m for m in zero_point.values())
    layers.replace_modules(model, {p: distill._ScaleTrainable(m, "float32")
                                   for p, m in zero_point.items()})
    np.testing.assert_allclose(np.array(model(ids)), np.array(want), rtol=1e-5, atol=1e-5)


def test_the_targets_are_the_teachers_largest_logits_and_distilling_on_them_helps(
        tiny, monkeypatch):
    """With fewer kept logits than the vocabulary (as for any real model: 1024 of 49k-262k),
    each position keeps exactly the teacher's k largest logits, and training on them still
    lowers held-out KL (over the whole vocabulary)."""
    source, teacher, _, train, held_out = tiny
    targets = distill._teacher_targets(teacher, train[:2], 16, lambda: None)
    for window in train[:2]:
        inputs = np.array(window[:-1], np.int32)
        logits, ids = targets[inputs.tobytes()]
        full = np.array(teacher(mx.array(inputs)[None])[0], np.float64)
        want = np.sort(full, axis=-1)[:, -16:]
        np.testing.assert_allclose(np.sort(np.array(logits), axis=-1), want, rtol=1e-6)
        np.testing.assert_array_equal(np.take_along_axis(full, np.array(ids), -1),
                                      np.array(logits, np.float64))
    monkeypatch.setattr(distill, "TOP_K", 16)
    model = quantized(source, "float16")
    kl_before = kl64(teacher, model, held_out)
    record = distill.distill_scales(model, teacher, train, dtype="float16", learning_rate=1e-4)
    assert record["kept"] and kl64(teacher, model, held_out) < 0.8 * kl_before, record


def test_the_stored_targets_hold_only_their_top_k_not_the_whole_vocabulary():
    """The kept logits and ids own their memory: a view of the (T - 1, vocab) argpartition
    would keep it alive for every window (Gemma-3: 29 x 537 MB, killed by the OOM killer)."""
    vocab, tokens, top_k, n_windows = 65536, 65, 256, 6
    windows = [[(w * 7 + t) % vocab for t in range(tokens)] for w in range(n_windows)]

    def teacher(ids: mx.array) -> mx.array:  # (1, T) -> (1, T, vocab) logits, seeded per window
        return mx.random.normal((1, ids.shape[1], vocab), key=mx.random.key(int(ids[0, 0])))

    mx.synchronize()
    mx.clear_cache()
    start = mx.get_active_memory()
    targets = distill._teacher_targets(teacher, windows, top_k, lambda: None)
    held = mx.get_active_memory() - start
    stored = n_windows * (tokens - 1) * top_k * 8  # float32 logits + int32 ids
    whole = (tokens - 1) * vocab * 4  # one window's argpartition
    assert len(targets) == n_windows and held < stored + whole, (held, stored)


def test_training_rounds_the_scales_as_they_are_stored():
    rng = np.random.default_rng(0)
    s = (rng.random(4000) * 0.1 + 1e-4).astype(np.float32)
    for dtype in ("float16", "bfloat16", "float32"):
        for bits in (4, 8):
            got = np.array(distill._rounded(mx.array(s), bits, dtype))
            np.testing.assert_array_equal(got, zp_format.round_scales(s, bits, dtype))
    # straight-through: the gradient of the rounding is the identity
    grad = mx.grad(lambda x: (distill._rounded(x, 4, "bfloat16") * mx.arange(3)).sum())
    np.testing.assert_array_equal(np.array(grad(mx.array([0.3, 0.01, 0.07]))), [0, 1, 2])


def test_a_distillation_that_makes_held_out_kl_worse_is_thrown_away(tiny):
    source, teacher, _, train, _ = tiny
    model = quantized(source, "float16")
    before = snapshot(model)
    record = distill.distill_scales(model, teacher, train, dtype="float16", epochs=1,
                                    learning_rate=0.5)  # far too large: the scales blow up
    assert not record["kept"] and not record["kl_after"] < record["kl_before"], record
    for path, arrays in snapshot(model).items():
        for got, want in zip(arrays, before[path], strict=True):
            np.testing.assert_array_equal(got, want)


def test_too_few_windows_is_an_error_before_training(tiny):
    source, teacher, _, train, _ = tiny
    with pytest.raises(QuantizationError, match="at least 8 calibration windows"):
        distill.distill_scales(quantized(source, "float16"), teacher, train[:7], dtype="float16")


def test_cli_distils_records_it_and_mlx_lm_loads_the_exact_weights(tiny, tmp_path):
    source = tiny[0]
    text = tmp_path / "calibration.txt"
    text.write_text(builtin_calibration_path().read_text()[: 9 * distill.WINDOW_TOKENS])
    out = tmp_path / "q4d"
    result = CliRunner().invoke(cli, [
        "quantize", str(source), "--out", str(out), "--method", "rtn", "-g", "32",
        "--dtype", "float16", "--calibration", str(text), "--distill-epochs", "1", "--no-eval"])
    assert result.exit_code == 0, result.output
    assert "distilled scales (1 epochs, 1 steps" in result.stdout
    record = json.loads((out / "config.json").read_text())["quantization"]["distillation"]
    assert record["epochs"] == 1 and record["windows"] == 5 and record["window_tokens"] == 513
    ours, _ = load(str(out))
    theirs, _ = mlx_lm.load(str(out))
    affine = {p: m for p, m in theirs.named_modules() if hasattr(m, "biases")}
    zero_point = layers.zero_point_modules(ours)
    assert set(affine) == set(zero_point)
    for path, m in affine.items():
        got = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
        want = zero_point[path].dequantize(mx.float32).astype(mx.float16)
        assert mx.array_equal(got, want).item(), path


def test_cli_refuses_a_calibration_text_too_short_to_distil_in_one_line(tiny, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text(builtin_calibration_path().read_text()[: 5 * distill.WINDOW_TOKENS])
    out = tmp_path / "q"
    result = CliRunner().invoke(cli, ["quantize", str(tiny[0]), "--out", str(out), "--method",
                                      "rtn", "-g", "32", "--calibration", str(text),
                                      "--distill-epochs", "2", "--no-eval"])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "distillation needs at least 8" in lines[0], result.stderr
    assert not out.exists() and not list(tmp_path.glob(".q*"))
