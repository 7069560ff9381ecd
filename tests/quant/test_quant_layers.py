"""Zero-point layers: numerics against numpy float64, drop-in use in mlx-lm models, the CPU path
policy, the zp loader, and AutoGPTQ / AutoAWQ checkpoints written by an independent exporter."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny_models import make_tiny_model

from mlxspec.load import load, weight_format
from mlxspec.quant import layers, rtn, zp_format
from mlxspec.quant.layers import ZeroPointEmbedding, ZeroPointLinear
from mlxspec.quant.quantize import quantize_model
from mlxspec.quant.storage import save_quantized

CPU_PATHS = ["dense", "quantized"]


@pytest.fixture
def cpu_path(request, monkeypatch):
    """Run the test with MLXSPEC_ZP_CPU set to the parametrized path."""
    monkeypatch.setenv(layers.CPU_PATH_ENV, request.param)
    return request.param


def random_quantized(rng, out_features, in_features, bits, group_size):
    q = rng.integers(0, 2**bits, (out_features, in_features))
    z = rng.integers(0, 2**bits, (out_features, in_features // group_size))
    s = (rng.random(z.shape) * 0.02 + 1e-3).astype(np.float16)
    return q, s, z


def reference_weight(q, s, z, group_size) -> np.ndarray:
    """w = s * (q - z), float64."""
    return np.repeat(s.astype(np.float64), group_size, 1) * (q - np.repeat(z, group_size, 1))


@pytest.mark.parametrize("cpu_path", CPU_PATHS, indirect=True)
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (4, 128), (8, 64), (3, 32), (2, 64)])
def test_linear_matches_float64_reference(cpu_path, bits, group_size):
    rng = np.random.default_rng(bits * group_size)
    q, s, z = random_quantized(rng, 96, 256, bits, group_size)
    bias = rng.standard_normal(96).astype(np.float32)
    layer = ZeroPointLinear.from_quantized(q, s, z, bits=bits, group_size=group_size, bias=bias)
    w = reference_weight(q, s, z, group_size)
    x = rng.standard_normal((2, 5, 256)).astype(np.float32)
    want = x.astype(np.float64) @ w.T + bias
    got = layer(mx.array(x))
    assert got.dtype == mx.float32 and got.shape == (2, 5, 96)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # float16 activations (a float16 model, whose bias would be float16 too): float16 tolerance.
    unbiased = ZeroPointLinear.from_quantized(q, s, z, bits=bits, group_size=group_size)
    got16 = unbiased(mx.array(x).astype(mx.float16))
    assert got16.dtype == mx.float16
    want16 = x.astype(np.float16).astype(np.float64) @ w.T
    np.testing.assert_allclose(np.array(got16.astype(mx.float32)), want16, rtol=2e-3,
                               atol=2e-3 * np.abs(want16).max())
    assert layers.matmul_path(96, 256) == cpu_path


@pytest.mark.parametrize("cpu_path", CPU_PATHS, indirect=True)
def test_linear_reproduces_each_weight_exactly_in_float32(cpu_path):
    # With one-hot inputs every output is a single weight s*(q - z): exact in float32 on both
    # paths (the affine form s*q + (-s*z) loses nothing either).
    rng = np.random.default_rng(7)
    q, s, z = random_quantized(rng, 40, 64, 4, 32)
    layer = ZeroPointLinear.from_quantized(q, s, z, bits=4, group_size=32)
    got = np.array(layer(mx.eye(64)))
    np.testing.assert_array_equal(got.T, reference_weight(q, s, z, 32).astype(np.float32))
    np.testing.assert_array_equal(np.array(layer.dequantize()), got.T)


@pytest.mark.parametrize("cpu_path", CPU_PATHS, indirect=True)
def test_permuted_linear_applies_its_input_permutation(cpu_path):
    rng = np.random.default_rng(8)
    q, s, z = random_quantized(rng, 32, 128, 4, 64)
    perm = rng.permutation(128)
    layer = ZeroPointLinear.from_quantized(q, s, z, bits=4, group_size=64, perm=perm)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    want = x[:, perm].astype(np.float64) @ reference_weight(q, s, z, 64).T
    np.testing.assert_allclose(np.array(layer(mx.array(x))), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cpu_path", CPU_PATHS, indirect=True)
def test_embedding_lookup_and_tied_head_match_the_reference(cpu_path):
    rng = np.random.default_rng(9)
    q, s, z = random_quantized(rng, 300, 64, 8, 32)
    table = ZeroPointEmbedding.from_quantized(q, s, z, bits=8, group_size=32)
    w = reference_weight(q, s, z, 32)
    ids = mx.array([[0, 5, 299], [17, 17, 3]])
    rows = table(ids)
    assert rows.dtype == mx.float32 and rows.shape == (2, 3, 64)
    np.testing.assert_array_equal(np.array(rows), w[np.array(ids)].astype(np.float32))
    x = rng.standard_normal((4, 64)).astype(np.float32)
    np.testing.assert_allclose(np.array(table.as_linear(mx.array(x))), x @ w.T, rtol=1e-5,
                               atol=1e-5)


def test_layers_rebuild_their_cache_when_load_weights_replaces_the_arrays(monkeypatch):
    monkeypatch.setenv(layers.CPU_PATH_ENV, "dense")
    rng = np.random.default_rng(10)
    first, second = random_quantized(rng, 8, 64, 4, 32), random_quantized(rng, 8, 64, 4, 32)
    layer = ZeroPointLinear.from_quantized(*first, bits=4, group_size=32)
    x = mx.array(rng.standard_normal((1, 64)).astype(np.float32))
    layer(x)
    other = ZeroPointLinear.from_quantized(*second, bits=4, group_size=32)
    layer.load_weights(list(tree_flatten(other.parameters())))
    np.testing.assert_array_equal(np.array(layer(x)), np.array(other(x)))


def test_cpu_policy_settings_and_budget(monkeypatch):
    monkeypatch.delenv(layers.CPU_PATH_ENV, raising=False)
    monkeypatch.setenv("MLXSPEC_CPU_QMM", "0")  # the budget applies without the packed kernel
    monkeypatch.setenv(layers.DENSE_BUDGET_ENV, "0")
    assert layers.matmul_path(64, 64) == "quantized"  # no room for a float32 copy
    monkeypatch.setenv(layers.DENSE_BUDGET_ENV, "1")
    assert layers.matmul_path(64, 64) == "dense"
    assert "float32 copy + BLAS" in layers.describe()
    monkeypatch.setenv(layers.CPU_PATH_ENV, "quantized")
    assert layers.matmul_path(64, 64) == "quantized"
    assert "quantized_matmul" in layers.describe()
    monkeypatch.setenv(layers.CPU_PATH_ENV, "fast")
    with pytest.raises(Exception, match="choose auto, dense or quantized"):
        layers.matmul_path(64, 64)


def test_dense_copies_are_counted_and_released(monkeypatch):
    import gc

    monkeypatch.setenv(layers.CPU_PATH_ENV, "dense")
    before = layers._dense_bytes
    layer = ZeroPointLinear.from_quantized(
        *random_quantized(np.random.default_rng(11), 128, 256, 4, 64), bits=4, group_size=64
    )
    layer(mx.zeros((1, 256)))
    assert layers._dense_bytes == before + 4 * 128 * 256
    del layer
    gc.collect()
    assert layers._dense_bytes == before


# -- whole models ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def dequantized_twin(quantized: nn.Module, twin: nn.Module) -> nn.Module:
    """Put into ``twin`` (a float copy of the same model) an nn.Linear/nn.Embedding for each of
    ``quantized``'s zero-point layers, holding its weight decoded with numpy in float64 (an
    independent path: numpy unpacking, plain float32 matmuls)."""
    new = {}
    for path, layer in layers.zero_point_modules(quantized).items():
        q = zp_format.unpack(np.array(layer.weight), layer.bits, layer.in_features)
        z = zp_format.unpack(np.array(layer.zeros), layer.bits, layer.in_features // layer.group_size)
        w = reference_weight(q.astype(np.int64), np.array(layer.scales), z.astype(np.int64),
                             layer.group_size).astype(np.float32)
        if isinstance(layer, ZeroPointEmbedding):
            dense = nn.Embedding(layer.num_embeddings, layer.dims)
        else:
            dense = nn.Linear(layer.in_features, layer.out_features, bias="bias" in layer)
            if "bias" in layer:
                dense.bias = layer.bias
            if "perm" in layer:  # undo the permutation: W[:, perm[j]] = Wp[:, j]
                unpermuted = np.empty_like(w)
                unpermuted[:, np.array(layer.perm)] = w
                w = unpermuted
        dense.weight = mx.array(w)
        new[path] = dense
    layers.replace_modules(twin, new)
    return twin


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantized_mlx_lm_model_matches_its_dequantized_twin(tiny_dir, method):
    model, _ = load(str(tiny_dir))
    calibration = [list(range(i, i + 32)) for i in range(0, 128, 32)]
    _, record = quantize_model(model, bits=4, group_size=32, method=method,
                               calibration_tokens=calibration, act_order=method == "gptq")
    kinds = {type(m) for m in layers.zero_point_modules(model).values()}
    assert kinds == {ZeroPointLinear, ZeroPointEmbedding}
    assert 4 < record["bits_per_weight"] < 6
    twin = dequantized_twin(model, load(str(tiny_dir))[0])
    x = mx.array([[1, 5, 9, 77, 200, 3]])
    np.testing.assert_allclose(np.array(model(x)), np.array(twin(x)), rtol=1e-4, atol=1e-4)


def test_zp_directory_round_trip_gives_identical_logits(tiny_dir, tmp_path):
    model, _ = load(str(tiny_dir))
    config = json.loads((tiny_dir / "config.json").read_text())
    _, record = quantize_model(model, bits=4, group_size=64, recipe="embed8")
    out = save_quantized(model, tmp_path / "q", config=config, quantization=record,
                         source_dir=tiny_dir, output_format="zp")
    saved = json.loads((out / "config.json").read_text())
    assert weight_format(saved) == "zp"
    assert saved["quantization"]["layers"] == {"model.embed_tokens": {"bits": 8, "group_size": 64}}
    loaded, _ = load(str(out))
    x = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    np.testing.assert_array_equal(np.array(loaded(x)), np.array(model(x)))
    assert loaded.model.embed_tokens.bits == 8 and loaded.model.layers[0].mlp.up_proj.bits == 4


# -- AutoGPTQ / AutoAWQ checkpoints ---------------------------------------------------------------


def pack_rows_bitstream(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack along axis 0 the way AutoGPTQ's pack() does: per column, a little-endian bit
    stream in which bit ``b`` of row ``i`` is stream bit ``i * bits + b`` (written bit by bit,
    independently of mlxspec.quant.zp_format)."""
    cols = values.shape[1]
    shifts = np.arange(bits, dtype=np.uint64)[None, :, None]
    stream = ((values.astype(np.uint64)[:, None, :] >> shifts) & np.uint64(1)).reshape(-1, cols)
    stream = np.pad(stream, ((0, -len(stream) % 32), (0, 0))).reshape(-1, 32, cols)
    out = (stream << np.arange(32, dtype=np.uint64)[None, :, None]).sum(axis=1)
    return out.astype(np.uint32).view(np.int32)


def export_gptq(model: nn.Module, path: Path, source_dir: Path, bits: int, group_size: int,
                act_order_layers: dict | None = None) -> None:
    """Write ``model``'s zero-point layers as an AutoGPTQ checkpoint (checkpoint_format "gptq":
    zeros stored minus one; act-order layers with g_idx); other tensors as they are."""
    path.mkdir(parents=True)
    tensors = float_tensors(model)
    for prefix, layer in layers.zero_point_modules(model).items():
        if isinstance(layer, ZeroPointEmbedding):
            continue
        q = zp_format.unpack(np.array(layer.weight), bits, layer.in_features).astype(np.int64)
        z = zp_format.unpack(np.array(layer.zeros), bits, layer.in_features // group_size)
        g_idx = np.arange(layer.in_features) // group_size
        if "perm" in layer:  # column j of q is input feature perm[j], in group j // g
            perm = np.array(layer.perm)
            natural_q = np.empty_like(q)
            natural_q[:, perm] = q
            q = natural_q
            g_idx = np.empty(layer.in_features, np.int64)
            g_idx[perm] = np.arange(layer.in_features) // group_size
        tensors[f"{prefix}.qweight"] = mx.array(pack_rows_bitstream(q.T, bits))
        stored_zeros = (z.T.astype(np.int64) - 1) % 2**bits  # (n_groups, out), minus one
        tensors[f"{prefix}.qzeros"] = mx.array(pack_rows_bitstream(stored_zeros.T, bits).T.copy())
        tensors[f"{prefix}.scales"] = mx.array(np.array(layer.scales).T.copy())
        tensors[f"{prefix}.g_idx"] = mx.array(g_idx.astype(np.int32))
    write_checkpoint(path, tensors, source_dir, {"quant_method": "gptq", "bits": bits,
                                                 "group_size": group_size, "desc_act": True})


def float_tensors(model: nn.Module) -> dict[str, mx.array]:
    """The model's unquantized tensors; zero-point embeddings dequantized (GPTQ and AWQ
    checkpoints keep embeddings in float)."""
    tensors = dict(tree_flatten(model.parameters()))
    for prefix, layer in layers.zero_point_modules(model).items():
        for key in ("weight", "scales", "zeros", "perm"):
            tensors.pop(f"{prefix}.{key}", None)
        if isinstance(layer, ZeroPointEmbedding):
            tensors[f"{prefix}.weight"] = layer.dequantize(mx.float32)
    return tensors


def write_checkpoint(path: Path, tensors: dict, source_dir: Path, quantization_config: dict):
    mx.save_safetensors(str(path / "model.safetensors"), tensors)
    config = json.loads((source_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    for f in source_dir.glob("tokenizer*"):
        shutil.copy(f, path / f.name)


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_awq(values: np.ndarray) -> np.ndarray:
    """AutoAWQ's GEMM packing of 4-bit ``values`` ``(rows, cols)``: 8 columns per int32, column
    ``AWQ_ORDER[k]`` of each 8 in nibble k."""
    rows, cols = values.shape
    packed = np.zeros((rows, cols // 8), np.uint32)
    for k, col in enumerate(AWQ_ORDER):
        packed |= values[:, col::8].astype(np.uint32) << (4 * k)
    return packed.view(np.int32)


def export_awq(model: nn.Module, path: Path, source_dir: Path, group_size: int) -> None:
    """Write ``model``'s 4-bit zero-point linears as an AutoAWQ GEMM checkpoint."""
    path.mkdir(parents=True)
    tensors = float_tensors(model)
    for prefix, layer in layers.zero_point_modules(model).items():
        if isinstance(layer, ZeroPointEmbedding):
            continue
        assert "perm" not in layer and layer.bits == 4
        q = zp_format.unpack(np.array(layer.weight), 4, layer.in_features)
        z = zp_format.unpack(np.array(layer.zeros), 4, layer.in_features // group_size)
        tensors[f"{prefix}.qweight"] = mx.array(pack_awq(q.T))  # (in, out / 8)
        tensors[f"{prefix}.qzeros"] = mx.array(pack_awq(z.T))  # (n_groups, out / 8)
        tensors[f"{prefix}.scales"] = mx.array(np.array(layer.scales).T.copy())
    write_checkpoint(path, tensors, source_dir, {"quant_method": "awq", "bits": 4,
                                                 "group_size": group_size, "version": "gemm",
                                                 "zero_point": True})


def test_gptq_act_order_checkpoint_loads_and_matches(tiny_dir, tmp_path):
    # mlx-lm refuses g_idx checkpoints; mlxspec loads them with the layer permutation.
    model, _ = load(str(tiny_dir))
    calibration = [list(range(i, i + 32)) for i in range(0, 128, 32)]
    quantize_model(model, bits=4, group_size=32, method="gptq", calibration_tokens=calibration,
                   act_order=True)
    export_gptq(model, tmp_path / "gptq", tiny_dir, 4, 32)
    assert weight_format(json.loads((tmp_path / "gptq" / "config.json").read_text())) == (
        "gptq/awq"
    )
    loaded, _ = load(str(tmp_path / "gptq"))
    assert "perm" in loaded.model.layers[0].self_attn.q_proj
    x = mx.array([[7, 8, 9, 10, 11]])
    np.testing.assert_allclose(np.array(loaded(x)), np.array(model(x)), rtol=1e-5, atol=1e-5)


def permuted_rtn_layer(weight: mx.array, rng, group_size: int) -> ZeroPointLinear:
    """An act-order style layer: groups of consecutive features of a random permutation."""
    perm = rng.permutation(weight.shape[1])
    w = np.array(weight.astype(mx.float32))[:, perm]
    q, s, z = rtn.quantize(w, 4, group_size)
    return ZeroPointLinear.from_quantized(q, s, z, bits=4, group_size=group_size, perm=perm)


@pytest.mark.slow
def test_smollm2_exported_as_awq_and_as_act_order_gptq_loads_back(smollm2_dir, smollm2,
                                                                   tmp_path):
    reference, _ = smollm2
    model, _ = load(str(smollm2_dir))
    quantize_model(model, bits=4, group_size=64, recipe="float-head")
    x = mx.array([[1, 504, 3300, 281, 1116, 30, 2]])
    want = np.array(model(x))
    export_awq(model, tmp_path / "awq", smollm2_dir, 64)
    awq, _ = load(str(tmp_path / "awq"))
    np.testing.assert_allclose(np.array(awq(x)), want, rtol=1e-4, atol=1e-4)
    del awq

    rng = np.random.default_rng(0)
    permuted = {}
    for i in (0, 14, 29):
        for name in ("self_attn.q_proj", "mlp.down_proj"):
            source = reference.model.layers[i]
            for part in name.split("."):
                source = source[part]
            permuted[f"model.layers.{i}.{name}"] = permuted_rtn_layer(source.weight, rng, 64)
    layers.replace_modules(model, permuted)
    want = np.array(model(x))
    export_gptq(model, tmp_path / "gptq", smollm2_dir, 4, 64)
    gptq_model, _ = load(str(tmp_path / "gptq"))
    assert "perm" in gptq_model.model.layers[14].mlp.down_proj
    assert "perm" not in gptq_model.model.layers[14].mlp.up_proj
    np.testing.assert_allclose(np.array(gptq_model(x)), want, rtol=1e-4, atol=1e-4)


# -- the exact MLX affine output (the default) ----------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_default_output_has_mlx_lm_layout_and_bits_per_weight(tiny_dir, tmp_path, dtype):
    # mlxspec's saved model holds exactly the tensors (names, shapes, dtypes) that mlx-lm's own
    # quantization of the same model in the same dtype holds, so the same bits per weight; and
    # the float parameters, scales and biases are all in the chosen dtype.
    from mlx_lm.utils import compute_bits_per_weight, load_model
    from mlx_lm.utils import quantize_model as mlx_lm_quantize

    from mlxspec.quant.storage import mlx_lm_loadable

    model, _ = load(str(tiny_dir))
    config = json.loads((tiny_dir / "config.json").read_text())
    _, record = quantize_model(model, bits=4, group_size=32, dtype=dtype)
    out = save_quantized(model, tmp_path / "q", config=config, quantization=record,
                         source_dir=tiny_dir)
    config_saved = json.loads((out / "config.json").read_text())
    saved = config_saved["quantization"]
    assert saved["format"] == "mlx" and saved["exact"] == dtype and saved["mode"] == "affine"
    loadable, why = mlx_lm_loadable(config_saved)  # what the Hub card says
    assert loadable and f"{dtype} scales and biases" in why and "bit for bit" in why
    ours, _ = load_model(out)  # plain mlx-lm
    theirs, _ = load_model(tiny_dir)
    theirs.set_dtype(getattr(mx, dtype))
    mlx_lm_quantize(theirs, config, group_size=32, bits=4)
    layout = lambda m: {k: (v.shape, v.dtype) for k, v in tree_flatten(m.parameters())}  # noqa: E731
    assert layout(ours) == layout(theirs)
    assert compute_bits_per_weight(ours) == compute_bits_per_weight(theirs)
    assert {v.dtype for _, v in tree_flatten(ours.parameters())} == {getattr(mx, dtype), mx.uint32}
    # mlxspec adopts the exact layers as zero-point layers and computes the same logits as the
    # in-memory model it saved.
    loaded, _ = load(str(out))
    assert isinstance(loaded.model.layers[0].mlp.up_proj, ZeroPointLinear)
    x = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert loaded(x).dtype == getattr(mx, dtype)


def test_act_order_cannot_be_saved_as_mlx_and_the_card_is_told_why(tiny_dir, tmp_path):
    from mlxspec.errors import QuantizationError
    from mlxspec.quant.storage import mlx_lm_loadable

    model, _ = load(str(tiny_dir))
    config = json.loads((tiny_dir / "config.json").read_text())
    calibration = [list(range(i, i + 32)) for i in range(0, 128, 32)]
    _, record = quantize_model(model, bits=4, group_size=32, method="gptq", act_order=True,
                               calibration_tokens=calibration)
    with pytest.raises(QuantizationError, match="act-order"):
        save_quantized(model, tmp_path / "q", config=config, quantization=record)
    assert not (tmp_path / "q").exists()
    out = save_quantized(model, tmp_path / "q", config=config, quantization=record,
                         output_format="zp")
    loadable, why = mlx_lm_loadable(json.loads((out / "config.json").read_text()))
    assert not loadable and "act-order" in why


def test_the_cpu_policy_follows_the_device_not_the_kernel_backend(monkeypatch):
    # On a Mac with the kernels switched off (MLXSPEC_KERNELS=mlx) layers stay packed on the GPU:
    # float32 copies are a CPU measure.
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setenv("MLXSPEC_KERNELS", "mlx")
    monkeypatch.setenv(layers.CPU_PATH_ENV, "dense")
    assert layers.matmul_path(64, 64) == "quantized"
    assert "GPU" in layers.describe()
    monkeypatch.delenv("MLXSPEC_KERNELS")
    assert layers.matmul_path(64, 64) == "metal"


def test_untied_embedding_lookups_never_make_a_dense_copy(monkeypatch):
    monkeypatch.setenv(layers.CPU_PATH_ENV, "dense")
    rng = np.random.default_rng(3)
    q, s, z = random_quantized(rng, 40, 64, 4, 32)
    before = layers._dense_bytes
    emb = ZeroPointEmbedding.from_quantized(q, s, z, bits=4, group_size=32)
    rows = emb(mx.array([0, 7, 39]))
    np.testing.assert_allclose(np.array(rows), reference_weight(q, s, z, 32)[[0, 7, 39]],
                               rtol=0, atol=1e-7)
    assert layers._dense_bytes == before and emb._cache.dense is None
    emb.as_linear(mx.zeros((1, 64)))  # the tied head is a matmul: the dense copy is allowed
    assert layers._dense_bytes == before + 4 * 40 * 64


def test_the_quant_package_has_no_import_cycle_and_never_imports_upper_layers():
    # Every import, lazy ones inside functions included: a lazy import dodging a cycle is a cycle.
    import ast

    root = Path(__file__).resolve().parents[2] / "mlxspec"
    files = {f"mlxspec.quant.{p.stem}": p for p in (root / "quant").glob("*.py")}
    files["mlxspec.gguf.tensors"] = root / "gguf" / "tensors.py"
    graph = {}
    for name, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
        upper = {m for m in imported if m.split(".")[:2] in (
            ["mlxspec", "load"], ["mlxspec", "evaluation"], ["mlxspec", "publish"],
            ["mlxspec", "generate"], ["mlxspec", "serving"], ["mlxspec", "cli"],
            ["mlxspec", "gguf"])} - {"mlxspec.gguf.tensors"}
        assert not upper, f"{name} imports {upper}"
        graph[name] = {m for m in imported if m in files and m != name}

    def visit(node, path):
        assert node not in path, f"import cycle: {' -> '.join([*path, node])}"
        for child in graph[node]:
            visit(child, [*path, node])

    for name in graph:
        visit(name, [])
