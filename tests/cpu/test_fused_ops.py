"""mlxspec.cpu.fused_ops: the compiled RoPE and RMSNorm give bitwise MLX's own results, with fewer ops.

The reference is MLX's own function (``fused_ops._reference``, or ``mx.fast`` when off), which
must match bit for bit, and a float64 numpy computation, which both must match closely (so a
compiled path that diverged the same way as the reference cannot pass unnoticed).
"""

from __future__ import annotations

import io
import re
import shutil
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlxspec.cpu import fused_ops
from tests.reference_numpy import rope_angles


@pytest.fixture(autouse=True)
def fused():
    """The compiled versions in place for each test, whatever the test did, as before after."""
    if shutil.which("g++") is None:
        pytest.skip("no g++: MLX's CPU compiler is off, so the compiled versions stay off")
    was_enabled = fused_ops.enabled()
    assert fused_ops.enable(), "the compiled versions should be in place on a CPU-only build"
    yield
    if was_enabled:
        fused_ops.enable()
    else:
        fused_ops.disable()


def reference(name: str):
    return fused_ops._reference[name]


def op_count(*outputs: mx.array) -> int:
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return len(re.findall(r'label ="', dot.getvalue()))


def numpy_rope(x: np.ndarray, dims: int, traditional: bool, base: float, scale: float,
               offsets: np.ndarray) -> np.ndarray:
    """x (B, H, T, D) float64, offsets (B,): MLX's RoPE convention in float64."""
    out = x.copy()
    for b, offset in enumerate(offsets):
        positions = (offset + np.arange(x.shape[2], dtype=np.float64)) * scale
        cos, sin = rope_angles(positions, dims, base)  # (T, dims/2)
        if traditional:
            first, second = x[b, ..., 0:dims:2], x[b, ..., 1:dims:2]
        else:
            first, second = x[b, ..., : dims // 2], x[b, ..., dims // 2 : dims]
        rotated = (first * cos - second * sin, first * sin + second * cos)
        if traditional:
            out[b, ..., 0:dims:2], out[b, ..., 1:dims:2] = rotated
        else:
            out[b, ..., : dims // 2], out[b, ..., dims // 2 : dims] = rotated
    return out


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(
    ("shape", "dims", "offset"),
    [
        ((1, 9, 1, 64), 64, 0),  # one decode step at the start
        ((1, 9, 1, 64), 64, 1234),  # a Python int offset, later in a sequence
        ((8, 3, 1, 64), 64, [5, 77, 0, 300, 1, 2, 4095, 64]),  # a batched step, one offset a row
        ((2, 4, 5, 64), 32, "scalar-array"),  # a verification step, half the dims rotated
        ((3, 7, 128), 128, 9),  # 3-D input (B, T, D)
    ],
)
def test_rope_is_bitwise_mlx_own(dtype, traditional, shape, dims, offset):
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    if offset == "scalar-array":
        offset = mx.array(17)
    elif isinstance(offset, list):
        offset = mx.array(offset)
    kwargs = dict(traditional=traditional, base=10000.0, scale=0.5, offset=offset)
    fused = fused_ops.rope(x, dims, **kwargs)
    ours = reference("rope")(x, dims, **kwargs)
    assert fused.dtype == ours.dtype == dtype
    assert mx.array_equal(fused, ours).item()

    offsets = np.broadcast_to(np.array(offset.tolist() if isinstance(offset, mx.array) else offset),
                              (shape[0],))
    x64 = np.array(x.astype(mx.float32)).astype(np.float64)
    x64 = x64[:, None] if x64.ndim == 3 else x64
    expected = numpy_rope(x64, dims, traditional, 10000.0, 0.5, offsets).reshape(shape)
    tolerance = 1e-4 if dtype == mx.float32 else 3e-2
    np.testing.assert_allclose(np.array(fused.astype(mx.float32)), expected, atol=tolerance,
                               rtol=tolerance)


def test_rope_with_frequencies_is_bitwise_mlx_own():
    """Llama 3 / YaRN scaling passes its own frequencies instead of a base."""
    x = mx.random.normal((2, 9, 1, 64), key=mx.random.key(1))
    freqs = mx.array(np.geomspace(1.0, 5e5, 32).astype(np.float32))
    kwargs = dict(traditional=False, base=None, scale=1.0, offset=mx.array([3, 900]), freqs=freqs)
    assert mx.array_equal(fused_ops.rope(x, 64, **kwargs), reference("rope")(x, 64, **kwargs)).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("shape", [(1, 1, 576), (8, 1, 576), (2, 5, 640), (576,)])
def test_rms_norm_is_bitwise_mlx_own(dtype, shape):
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    weight = mx.array(rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32)).astype(dtype)
    fused = fused_ops.rms_norm(x, weight, 1e-5)
    ours = reference("rms_norm")(x, weight, 1e-5)
    assert fused.dtype == ours.dtype == dtype
    assert mx.array_equal(fused, ours).item()
    x64 = np.array(x.astype(mx.float32)).astype(np.float64)
    w64 = np.array(weight.astype(mx.float32)).astype(np.float64)
    expected = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-5) * w64
    tolerance = 1e-5 if dtype == mx.float32 else 3e-2
    np.testing.assert_allclose(np.array(fused.astype(mx.float32)), expected, atol=tolerance,
                               rtol=tolerance)


def test_small_inputs_take_the_compiled_path_and_long_ones_mlx_own():
    """The point is fewer ops: a decode-sized call is a few compiled ops, not MLX's graph; a
    long prefill keeps MLX's graph (no trace per prompt length)."""
    x = mx.random.normal((4, 9, 1, 64), key=mx.random.key(2))
    offset = mx.array([1, 2, 3, 4])
    kwargs = dict(traditional=False, base=10000.0, scale=1.0, offset=offset)
    assert op_count(fused_ops.rope(x, 64, **kwargs)) < op_count(reference("rope")(x, 64, **kwargs))
    h, w = mx.ones((4, 1, 576)), mx.ones((576,))
    assert op_count(fused_ops.rms_norm(h, w, 1e-5)) < op_count(reference("rms_norm")(h, w, 1e-5))

    long = mx.random.normal((1, 9, fused_ops.MAX_FUSED_TOKENS + 1, 64), key=mx.random.key(3))
    kwargs["offset"] = 0
    assert op_count(fused_ops.rope(long, 64, **kwargs)) == op_count(reference("rope")(long, 64, **kwargs))
    assert mx.array_equal(fused_ops.rope(long, 64, **kwargs), reference("rope")(long, 64, **kwargs)).item()


def test_calls_at_one_position_share_their_tables():
    """A decode step's RoPE calls (2 a layer, one position) compute the cosines and sines once:
    the second call adds only its rotation to the graph, and both stay bitwise MLX's."""
    kwargs = dict(traditional=False, base=10000.0, scale=1.0, offset=4321)
    q, k = (mx.random.normal((1, h, 1, 64), key=mx.random.key(h)) for h in (9, 3))
    one = op_count(fused_ops.rope(q, 64, **kwargs))
    both = fused_ops.rope(q, 64, **kwargs), fused_ops.rope(k, 64, **kwargs)
    assert op_count(*both) < 2 * one - 4
    for x, out in zip((q, k), both, strict=True):
        assert mx.array_equal(out, reference("rope")(x, 64, **kwargs)).item()


def test_threads_sharing_the_tables_memo_never_collide(monkeypatch):
    """Threads decoding at once (the serving engine's and another) evict from one memo: each
    call returns its own position's tables and none fails (two evicting the same oldest entry
    raised KeyError)."""
    monkeypatch.setattr(fused_ops, "_tables", lambda offset, *_: (offset, offset))
    monkeypatch.setattr(fused_ops, "_tables_kept", {})
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # a thread switch between any two bytecodes, as under load
    failures = []

    def decode(seed: int) -> None:
        try:
            for i in range(20_000):
                offset = 1 + (7 * i + seed) % 50
                got = fused_ops._shared_tables(offset, 1, 64, False, 1e4, 1.0, None, mx.float32)
                assert got == (offset, offset)
        except Exception as e:  # reported below, from the main thread
            failures.append(repr(e))

    threads = [threading.Thread(target=decode, args=(seed,)) for seed in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures, failures[:3]
    assert len(fused_ops._tables_kept) <= fused_ops._TABLES_KEPT


def test_enable_swaps_mx_fast_and_disable_puts_mlx_own_back(monkeypatch):
    assert mx.fast.rope is fused_ops.rope and mx.fast.rms_norm is fused_ops.rms_norm
    original = reference("rope"), reference("rms_norm")
    fused_ops.disable()
    assert (mx.fast.rope, mx.fast.rms_norm) == original and not fused_ops.enabled()
    monkeypatch.setenv("MLXSPEC_FUSED_OPS", "0")
    assert fused_ops.enable() is False and mx.fast.rope is original[0]
    assert "MLXSPEC_FUSED_OPS=0" in fused_ops.describe()
    monkeypatch.delenv("MLXSPEC_FUSED_OPS")
    assert fused_ops.enable() is True and mx.fast.rope is fused_ops.rope
    assert fused_ops.describe().startswith("compiled")


def greedy_with_logprobs(model, prompt: mx.array, steps: int) -> tuple[list[int], list[mx.array]]:
    tokens, logprobs = [], []
    for token, logprob in generate_step(prompt, model, max_tokens=steps):
        tokens.append(int(token))
        logprobs.append(logprob)
    assert len(tokens) == steps
    return tokens, logprobs


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_real_model_decodes_bitwise_the_same(name, request):
    """SmolLM2 (Llama) and Gemma-3 decode with the compiled ops exactly as with MLX's own: the
    same tokens and bitwise the same log-probabilities at every step."""
    model, tokenizer = request.getfixturevalue(name)
    prompt = mx.array(tokenizer.encode("The lighthouse keeper opened the bottle and read"))
    fused_tokens, fused_logprobs = greedy_with_logprobs(model, prompt, 12)
    fused_ops.disable()
    tokens, logprobs = greedy_with_logprobs(model, prompt, 12)
    assert fused_tokens == tokens
    assert all(mx.array_equal(a, b).item() for a, b in zip(fused_logprobs, logprobs, strict=True))
