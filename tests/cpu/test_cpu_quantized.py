"""mlxspec.cpu.quantized: affine-quantized products on the packed weights, against a float64
numpy product, row by row the same bits whatever the number of rows, and wired into the default
model (no float32 copies) without touching models loaded through plain mlx-lm.

Tolerance of the kernel against float64: each output is a float32 sum of K products w * x, where
w = fma(q, s, b) is rounded once and the sum runs in at most K sequential additions per lane
plus a fixed reduction of the lanes (the larger products: sgemm over the same w). The classic
bound for a recursive sum is |error| <= (n + 1) u sum_i |w_i x_i| with u = 2^-24 and n <= K; the
test allows (K + 2) u sum_i |w_i x_i|, computed in float64 per output. A misplaced weight or
scale gives errors of the size of the output itself, orders of magnitude above it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlxspec
from mlxspec import cpu
from mlxspec.cache import make_cache
from mlxspec.cpu import quantized
from mlxspec.quant.layers import ZeroPointEmbedding, ZeroPointLinear, zero_point_modules
from mlxspec.serving.decode_batch import last_token_logits
from mlxspec.serving.fused_prefill import Part, fused_logits
from tests.serving.test_fused_prefill import _joining, _running_rows, _states

pytestmark = pytest.mark.skipif(not quantized.enable(),
                                reason=f"no packed-weight kernel here: {quantized.describe()}")

U = 2.0**-24


def random_layer(rng, n: int, k: int, bits: int, group_size: int, dtype):
    """(weight uint32, scales, biases) in MLX's layout with random integers, and numpy copies."""
    weight = rng.integers(0, 2**32, size=(n, k * bits // 32), dtype=np.uint32)
    scales = rng.uniform(0.005, 0.05, size=(n, k // group_size)).astype(np.float32)
    biases = rng.uniform(-1.0, 1.0, size=(n, k // group_size)).astype(np.float32)
    arrays = [mx.array(weight), mx.array(scales).astype(dtype), mx.array(biases).astype(dtype)]
    as_numpy = [weight] + [np.array(a.astype(mx.float32)) for a in arrays[1:]]
    return arrays, as_numpy


def assert_close_to_float64(got: mx.array, x: np.ndarray, numpy_layer, group_size, bits,
                            int8: bool = False):
    weight, scales, biases = numpy_layer
    slack = 2
    if int8:
        # x rounded as llama.cpp rounds it (its Q8_1), in float32 as the kernel does: per block
        # of 32, dx = max |x| / 127 and x -> dx * round(x * 127 / max |x|); the product is then
        # sum (s q + b) * rounded x, exactly but for float32 roundings (the integer sums are
        # exact: a few more roundings per output than the float path)
        blocks = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
        amax = np.abs(blocks).max(-1, keepdims=True)
        inv = np.float32(127) / np.where(amax > 0, amax, np.float32(1))
        dx = (amax / np.float32(127)).astype(np.float64)
        x = (dx * np.rint(blocks * inv).astype(np.float64)).reshape(x.shape)
        slack = 8
    want = quantized.reference(x, weight, scales, biases, group_size, bits)
    magnitude = quantized.reference(np.abs(x), weight, np.abs(scales), np.abs(biases),
                                    group_size, bits)  # sum |w x| >= sum over |s q| + |b|
    bound = (x.shape[-1] + slack) * U * magnitude
    error = np.abs(np.array(got, dtype=np.float64) - want)
    assert got.dtype == mx.float32 and got.shape == want.shape
    assert (error <= bound).all(), f"worst error {error.max():.3g}, bound there {bound.max():.3g}"


def _has_vnni() -> bool:
    module = quantized._state.get("module")
    return module is not None and bool(module.int8_activations)


ACTIVATIONS = ["float32", "int8"] if _has_vnni() else ["float32"]


@pytest.fixture(params=ACTIVATIONS)
def activation(request, monkeypatch):
    """Each test runs with float32 activations and, where the CPU has VNNI, int8 ones."""
    monkeypatch.setenv(quantized.ACTIVATIONS, request.param)
    return request.param


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_products_match_float64_on_every_layout(bits, group_size, dtype, activation):
    rng = np.random.default_rng(bits * 1000 + group_size)
    n, k = 37, 3 * group_size  # 37 rows: not a multiple of any tile
    arrays, numpy_layer = random_layer(rng, n, k, bits, group_size, dtype)
    rows = range(1, 25) if group_size == 64 else (1, 2, 3, 5, 24)
    for m in (*rows, 25, 40):  # more than 24 rows: dequantized tiles through sgemm
        x = rng.standard_normal((m, k)).astype(np.float32)
        got = cpu.quantized_matmul(mx.array(x), *arrays, group_size=group_size, bits=bits)
        int8 = activation == "int8" and m <= 24  # larger products: float32 (sgemm)
        assert_close_to_float64(got, x, numpy_layer, group_size, bits, int8)


def test_int8_activations_cover_odd_lengths_and_the_last_row():
    """Rows of W shorter than a 64-byte block or ending inside one (masked loads): K = 32, 96,
    160 and 608 at both widths, the matrix's last row included."""
    if "int8" not in ACTIVATIONS:
        pytest.skip("no VNNI here")
    rng = np.random.default_rng(9)
    for bits in (4, 8):
        for k in (32, 96, 160, 608):
            arrays, numpy_layer = random_layer(rng, 5, k, bits, 32, mx.float16)
            x = rng.standard_normal((3, k)).astype(np.float32)
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv(quantized.ACTIVATIONS, "int8")
                got = cpu.quantized_matmul(mx.array(x), *arrays, group_size=32, bits=bits)
            assert_close_to_float64(got, x, numpy_layer, 32, bits, int8=True)


def test_leading_axes_strided_inputs_and_other_activation_dtypes(activation):
    rng = np.random.default_rng(1)
    arrays, numpy_layer = random_layer(rng, 19, 128, 4, 32, mx.float16)
    x = rng.standard_normal((2, 3, 256)).astype(np.float32)
    strided = mx.array(x)[..., ::2]  # every other column: not contiguous
    got = cpu.quantized_matmul(strided, *arrays, group_size=32, bits=4)
    assert got.shape == (2, 3, 19)
    assert_close_to_float64(got.reshape(6, 19), x[..., ::2].reshape(6, 128), numpy_layer, 32, 4,
                            activation == "int8")
    half = cpu.quantized_matmul(mx.array(x[..., :128]).astype(mx.bfloat16), *arrays,
                                group_size=32, bits=4)
    assert half.dtype == mx.bfloat16
    # layouts the kernel does not take: None, so callers use MLX's own product
    assert cpu.quantized_matmul(mx.array(x[..., :128]), *arrays, group_size=32, bits=5) is None
    assert cpu.quantized_matmul(mx.array(x[..., :64]), *arrays, group_size=32, bits=4) is None


@pytest.mark.parametrize("bits", [4, 8])
def test_each_output_has_the_same_bits_whatever_the_number_of_rows(bits, activation):
    """What mlxspec.serving.fused_prefill relies on: rows multiplied together (and on the pool's
    threads: SmolLM2's MLP shape) give each row the bits it gets alone, for 1 to 24 rows."""
    rng = np.random.default_rng(bits)
    arrays, _ = random_layer(rng, 1536, 576, bits, 32, mx.float16)
    x = mx.array(rng.standard_normal((24, 576)).astype(np.float32))
    alone = mx.concatenate([cpu.quantized_matmul(x[i:i + 1], *arrays, group_size=32, bits=bits)
                            for i in range(24)])
    for m in range(1, 25):
        together = cpu.quantized_matmul(x[:m], *arrays, group_size=32, bits=bits)
        assert mx.array_equal(together, alone[:m]).item(), f"{m} rows"


def test_zero_point_layers_run_packed_without_float32_copies():
    rng = np.random.default_rng(2)
    q = rng.integers(0, 16, (40, 128))
    z = rng.integers(0, 16, (40, 4))
    s = (rng.random((40, 4)) * 0.02 + 1e-3).astype(np.float16)
    layer = ZeroPointLinear.from_quantized(q, s, z, bits=4, group_size=32)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    got = layer(mx.array(x))
    assert layer._cache.path == "packed" and layer._cache.dense is None
    w = np.repeat(s.astype(np.float64), 32, 1) * (q - np.repeat(z, 32, 1))
    want = x.astype(np.float64) @ w.T
    bound = 130 * U * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    assert (np.abs(np.array(got, dtype=np.float64) - want) <= bound).all()


def test_install_gives_mlx_quantized_layers_the_kernel_and_leaves_mx_alone():
    rng = np.random.default_rng(3)
    model = nn.Sequential(nn.Embedding(64, 128), nn.Linear(128, 96, bias=True))
    nn.quantize(model, group_size=64, bits=8)
    x = mx.array(rng.standard_normal((2, 128)).astype(np.float32))
    linear, embedding = model.layers[1], model.layers[0]
    before = linear(x), embedding.as_linear(x)
    assert quantized.install(model) == 2
    assert type(linear) is quantized.QuantizedLinear and isinstance(linear, nn.QuantizedLinear)
    after = linear(x), embedding.as_linear(x)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-4)
    plain = nn.QuantizedLinear(128, 32, bias=False, group_size=64, bits=8)
    want = mx.quantized_matmul(x, plain.weight, plain.scales, plain.biases, group_size=64, bits=8)
    assert mx.array_equal(plain(x), want).item()  # MLX's own product: nothing patched globally


def test_install_gives_mlx_tensor_parallel_quantized_layers_the_kernel():
    """``--shard tensor`` turns a model's quantized layers into MLX's sharded ones, whose own call
    is ``mx.quantized_matmul`` (MLX's slow CPU path): they get the kernel too (a group of one
    process here; tests/distributed runs two)."""
    rng = np.random.default_rng(4)
    group = mx.distributed.init()
    layers = [nn.QuantizedLinear(128, 128, bias=True, group_size=32, bits=4) for _ in range(2)]
    for layer in layers:  # a bias of zeros (the default) would hide a bias left out
        layer.bias = mx.array(rng.uniform(-1, 1, 128).astype(np.float32))
    model = nn.Sequential(
        nn.QuantizedAllToShardedLinear.from_quantized_linear(layers[0], group=group),
        nn.QuantizedShardedToAllLinear.from_quantized_linear(layers[1], group=group))
    x = mx.array(rng.standard_normal((3, 128)).astype(np.float32))
    before = [layer(x) for layer in model.layers]
    assert quantized.install(model) == 2
    assert [type(layer) for layer in model.layers] == [quantized.QuantizedAllToShardedLinear,
                                                       quantized.QuantizedShardedToAllLinear]
    for layer, want in zip(model.layers, before, strict=True):
        weight, scales, biases = (np.array(layer[k]) for k in ("weight", "scales", "biases"))
        got = layer(x)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-4)
        assert_close_to_float64(got - layer["bias"], np.array(x), (weight, scales, biases), 32, 4)


# -- the default model, as mlxspec.load() runs it ------------------------------------------------


@pytest.fixture(scope="module")
def packed():
    """(model, tokenizer) of the default model with its GGUF blocks kept packed
    (``MLXSPEC_GGUF_WEIGHTS=quantized``; the default converts GGUF files to float32 on a CPU)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXSPEC_GGUF_WEIGHTS", "quantized")
        return mlxspec.load()


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    cache, tokens = make_cache(model), []
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    for _ in range(steps):
        tokens.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
    return tokens


def test_default_model_stays_packed_and_is_small(packed):
    model, _ = packed
    layers = [m for _, m in model.named_modules()
              if isinstance(m, nn.QuantizedLinear | ZeroPointLinear | ZeroPointEmbedding)]
    assert len(layers) == 30 * 7 + 1  # every projection, and the tied embedding/head
    assert all(type(m) is not nn.QuantizedLinear for m in layers)  # all given the kernel
    nbytes = sum(v.nbytes for _, v in mlxspec_tree(model))
    assert nbytes < 0.13e9  # ~4.5 bits a weight; float32 copies would be 0.54 GB
    model(mx.array([[1, 2, 3]]))
    assert all(m._cache.dense is None for m in zero_point_modules(model).values())
    assert "packed" in cpu.report(measure=False)["quantized_products"]


def mlxspec_tree(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def test_default_model_greedy_tokens_are_mlx_quantized_paths(packed, monkeypatch):
    """The kernel sums in another order than MLX's own CPU quantized_matmul; over 24 greedy
    tokens of the default model the text is the same."""
    model, tokenizer = packed
    prompt = tokenizer.encode("The three primary colors are")
    ours = _greedy(model, prompt, 24)
    monkeypatch.setenv(quantized.SWITCH, "0")  # the same layers, MLX's own products
    assert _greedy(model, prompt, 24) == ours


def test_fused_prefill_is_bitwise_the_two_forwards_on_the_packed_model(packed):
    model, tokenizer = packed
    prompts = [tokenizer.encode("Write a haiku about the sea, then explain it.")[:13]]
    inputs = mx.array([[100 + i] for i in range(8)])
    apart_rows, (tokens, apart_group, n) = _running_rows(model), _joining(model, prompts)
    decode = model(inputs, cache=apart_rows)[:, -1]
    prefill = last_token_logits(model, tokens, apart_group, n)
    fused_rows, (tokens, fused_group, n) = _running_rows(model), _joining(model, prompts)
    fused_decode, fused_prefill = fused_logits(
        model, [Part(inputs, fused_rows), Part(tokens, fused_group, [k - 1 for k in n])])
    assert mx.array_equal(fused_decode, decode).item()
    assert mx.array_equal(fused_prefill, prefill).item()
    assert all(mx.array_equal(a, b).item()
               for a, b in zip(_states(apart_group), _states(fused_group), strict=True))


_PLAIN = """
import sys, json
import mlxspec, mlx.core as mx
from mlx_lm import load
model, _ = load(sys.argv[1])
print(json.dumps(model(mx.array([[1, 2, 3, 4]]))[0, -1, :64].tolist()))
"""


def test_a_model_loaded_through_plain_mlx_lm_gives_the_same_results(packed):
    """Loaded with mlx_lm.load in a process where mlxspec.load has installed the kernel: MLX's
    own layers and products, the logits bitwise those of a process where it never ran."""
    from mlx_lm import load

    from mlxspec.load import resolve_model_path

    directory = str(resolve_model_path(None))
    plain, _ = load(directory)
    assert not any(type(m).__module__.startswith("mlxspec") for _, m in plain.named_modules())
    here = plain(mx.array([[1, 2, 3, 4]]))[0, -1, :64].tolist()
    result = subprocess.run([sys.executable, "-c", _PLAIN, directory], capture_output=True,
                            text=True, check=True, timeout=300)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == here


def test_packed_or_dense_is_measured_once_per_machine_and_the_record_decides(tmp_path,
                                                                            monkeypatch):
    """GGUF imports stay packed where a decode product measured faster on the kernel than on a
    float32 copy: the numbers are kept in MLXSPEC_HOME, and the kept record (not a new
    measurement) decides afterwards; MLXSPEC_GGUF_WEIGHTS still overrides it."""
    from mlxspec.gguf import tensors

    monkeypatch.setenv("MLXSPEC_HOME", str(tmp_path))
    monkeypatch.delenv(tensors.MODE_ENV, raising=False)
    monkeypatch.delitem(quantized._state, "choice", raising=False)
    pays, measured = cpu.packed_weights_pay()
    path = tmp_path / "cpu_ops" / quantized.CHOICE_FILE
    saved = json.loads(path.read_text())
    assert list(saved.values()) == [measured] and measured["packed_ms"] > 0
    assert pays == (measured["packed_ms"] < measured["dense_ms"])
    slower = {"packed_ms": 2.0, "dense_ms": 1.0}
    path.write_text(json.dumps({key: slower for key in saved}))
    quantized._state.pop("choice")
    assert cpu.packed_weights_pay() == (False, slower)
    assert tensors.import_mode() == "dense" and "2.000 ms packed" in tensors.describe()
    monkeypatch.setenv(tensors.MODE_ENV, "quantized")
    assert tensors.import_mode() == "quantized"
