"""mlxspec.cpu.ops: the attention and greedy-candidates primitives give bitwise MLX's own results.

The reference is MLX's own composition (``cpu_ops._state["reference"]`` for the attention,
``mx.argmax`` and friends for the greedy candidates), which must match bit for bit, and a float64
numpy computation, which both must match closely (so a primitive that diverged the same way as
the reference cannot pass unnoticed).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.cpu import blas
from mlxspec.cpu import ops as cpu_ops
from mlxspec.serving.rows import GREEDY_TIE, greedy_candidates
from tests.cpu.test_fused_ops import greedy_with_logprobs


@pytest.fixture(autouse=True)
def ops():
    """The primitives in place for each test, whatever the test did, as before after."""
    if shutil.which("g++") is None:
        pytest.skip("no g++: the primitives cannot be built here, MLX's own ops run instead")
    was_enabled = cpu_ops.enabled()
    assert cpu_ops.enable(), f"the primitives should load on a CPU-only build: {cpu_ops.describe()}"
    yield
    if not was_enabled:
        cpu_ops.disable()


def mlx_own(q, k, v, scale, mask):
    return cpu_ops._state["reference"](q, k, v, scale=scale, mask=mask)


def numpy_attention(q, k, v, scale, mask) -> np.ndarray:
    """float64: q (B, H, Lq, D), k and v (B, KV, L, D), mask None / "causal" / bool / additive."""
    q, k, v = (np.array(a, dtype=np.float64) for a in (q, k, v))
    repeats = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, repeats, axis=1), np.repeat(v, repeats, axis=1)
    scores = scale * q @ k.swapaxes(-1, -2)
    lq, length = scores.shape[-2:]
    if isinstance(mask, str):
        scores = np.where(np.arange(lq)[:, None] + length - lq >= np.arange(length), scores, -np.inf)
    elif mask is not None and mask.dtype == mx.bool_:
        scores = np.where(np.array(mask), scores, -np.inf)
    elif mask is not None:
        scores = scores + np.array(mask, dtype=np.float64)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    return (scores / scores.sum(-1, keepdims=True)) @ v


def inputs(batch, heads, kv_heads, q_len, length, dim, layout, seed):
    """q from (B, Lq, H, D) transposed, as mlx-lm's attention makes it; k and v as a KV cache
    hands them out (a slice of a longer buffer) or straight from the projections (transposed)."""
    key = mx.random.key(seed)
    keys = mx.random.split(key, 3)
    q = mx.random.normal((batch, q_len, heads, dim), key=keys[0]).transpose(0, 2, 1, 3)
    if layout == "cache":
        k = mx.random.normal((batch, kv_heads, length + 9, dim), key=keys[1])[:, :, :length]
        v = mx.random.normal((batch, kv_heads, length + 9, dim), key=keys[2])[:, :, :length]
    else:
        k = mx.random.normal((batch, length, kv_heads, dim), key=keys[1]).transpose(0, 2, 1, 3)
        v = mx.random.normal((batch, length, kv_heads, dim), key=keys[2]).transpose(0, 2, 1, 3)
    return q, k, v


SHAPES = [  # batch, heads, kv heads, query positions, key positions, head dimension
    (1, 9, 3, 1, 100, 64),  # SmolLM2 decoding one row
    (8, 9, 3, 1, 77, 64),  # and eight
    (2, 9, 3, 5, 50, 64),  # speculative verification
    (1, 8, 8, 30, 30, 128),  # a prefill chunk, no GQA
    (2, 4, 1, 3, 300, 80),  # one KV head, a head size that is not a multiple of 16
    (3, 4, 2, 1, 1, 32),  # a single key position
    (2, 6, 2, 9, 600, 256),  # Gemma-3's head size, over 256 key positions
    (1, 32, 4, 27, 40, 64),  # 8 heads a KV head: more rows than the shim's kernels take at once
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["cache", "projections"])
@pytest.mark.parametrize("mask_kind", [None, "causal", "bool", "additive"])
def test_attention_is_bitwise_mlx_own(shape, layout, mask_kind):
    batch, heads, kv_heads, q_len, length, dim = shape
    q, k, v = inputs(*shape, layout, seed=sum(shape))
    mask = {None: None, "causal": "causal",
            "bool": mx.random.uniform(shape=(batch, 1, q_len, length), key=mx.random.key(1)) > 0.3,
            "additive": mx.random.normal((batch, heads, q_len, length), key=mx.random.key(2))
            }[mask_kind]
    if mask_kind == "bool":  # every query keeps a key (an all-masked row is MLX's uniform row)
        mask[..., -1] = True
    scale = dim**-0.5
    got = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    expected = mlx_own(q, k, v, scale, mask)
    assert got.dtype == mx.float32 and got.shape == expected.shape == (batch, heads, q_len, dim)
    assert np.array_equal(np.array(got), np.array(expected))
    error = np.abs(np.array(got, dtype=np.float64) - numpy_attention(q, k, v, scale, mask))
    assert error.max() < 1e-5


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("q_len", [1, 4])
def test_a_rows_hidden_padding_is_not_read(mask_kind, q_len):
    """A batch's rows are left-padded to its longest; each row's keys start after the padding
    its mask hides (``hidden_prefix``). The proof: an infinite value in the hidden keys and
    values changes nothing (MLX's own gives NaN there, 0 x inf), and each row's output is,
    bitwise, MLX's own attention over that row's visible keys only; with finite padding it is
    MLX's own over the whole padded batch."""
    if blas._shim is None or blas._shim.mlxspec_blas_skinny_mode() & 3 != 3:  # routed, a kernel
        pytest.skip("without the BLAS shim's kernels every key is read (BLAS may sum otherwise)")
    batch, heads, kv_heads, length, dim = 3, 9, 3, 90, 64
    pads = [0, 37, 70]  # the longest row, two that joined later
    q, k, v = inputs(batch, heads, kv_heads, q_len, length, dim, "cache", seed=3)
    visible = mx.arange(length)[None, :] >= mx.array(pads)[:, None]  # (batch, length)
    causal = mx.arange(q_len)[:, None] + length - q_len >= mx.arange(length)[None, :]
    mask = visible[:, None, None, :] & causal[None, None]  # (batch, 1, q_len, length)
    if mask_kind == "additive":
        mask = mx.where(mask, 0.0, -mx.inf).astype(mx.float32)
    scale = dim**-0.5
    finite = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    assert np.array_equal(np.array(finite), np.array(mlx_own(q, k, v, scale, mask)))
    hidden = ~visible[:, None, :, None]  # (batch, 1, length, 1)
    k_bad, v_bad = mx.where(hidden, mx.inf, k), mx.where(hidden, mx.inf, v)
    got = np.array(mx.fast.scaled_dot_product_attention(q, k_bad, v_bad, scale=scale, mask=mask))
    assert np.isnan(np.array(mlx_own(q, k_bad, v_bad, scale, mask))).any()  # they were read
    assert np.array_equal(got, np.array(finite))
    for b, pad in enumerate(pads):
        alone = mlx_own(q[b : b + 1], k[b : b + 1, :, pad:], v[b : b + 1, :, pad:], scale,
                        mask[b : b + 1, ..., pad:])
        assert np.array_equal(got[b : b + 1], np.array(alone))


def test_threads_do_not_change_the_numbers():
    """Large enough, the (row, KV head) pairs run on the BLAS shim's threads: one thread or
    several, MLX's own numbers."""
    if blas._shim is None:
        pytest.skip("mlxspec's BLAS shim is not loaded: the pairs run on MLX's thread only")
    q, k, v = inputs(8, 9, 3, 1, 400, 64, "cache", seed=5)
    mask = mx.arange(400)[None, None, None, :] >= mx.arange(8)[:, None, None, None]
    expected = np.array(mlx_own(q, k, v, 0.125, mask))
    threads = blas._shim.mlxspec_blas_threads()
    try:
        for count in (1, 2, 3):
            blas._shim.mlxspec_blas_set_threads(count)
            got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
            assert np.array_equal(np.array(got), expected)
    finally:
        blas._shim.mlxspec_blas_set_threads(threads)


def test_other_inputs_go_to_mlx_own():
    """float16, attention sinks, an explicit stream and malformed masks are MLX's own to handle
    (with MLX's own errors)."""
    q, k, v = inputs(2, 4, 2, 3, 20, 16, "cache", seed=0)
    half = [a.astype(mx.float16) for a in (q, k, v)]
    assert mx.fast.scaled_dot_product_attention(*half, scale=0.25).dtype == mx.float16
    sinks = mx.zeros((4,))
    with_sinks = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, sinks=sinks)
    assert mx.array_equal(with_sinks, cpu_ops._state["reference"](q, k, v, scale=0.25, sinks=sinks))
    on_stream = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, stream=mx.cpu)
    assert mx.array_equal(on_stream, mlx_own(q, k, v, 0.25, None))
    with pytest.raises(ValueError):
        mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mx.ones((5, 5), mx.bool_))
    with pytest.raises(ValueError, match="invalid mask option"):
        mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="sliding")


def test_gradients_are_mlx_own():
    q, k, v = inputs(2, 4, 2, 3, 7, 16, "cache", seed=3)

    def loss(attention):
        return lambda q, k, v: (attention(q, k, v, scale=0.3, mask="causal") ** 2).sum()

    own = mx.grad(loss(cpu_ops._state["reference"]), argnums=(0, 1, 2))(q, k, v)
    through = mx.grad(loss(mx.fast.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(own, through, strict=True):
        assert np.array_equal(np.array(a), np.array(b))


def test_greedy_candidates_are_mlx_own():
    """Ties, near-ties, NaN (first or later), infinities and signed zeros, contiguous rows and
    strided ones: the argmax and the near-tie count as MLX's own ops compute them (the same
    function with the primitives off)."""
    x = np.random.default_rng(0).standard_normal((15, 1000)).astype(np.float32)
    x[1, 5] = x[1, 9] = x[1].max() + 1  # a tie: the first index
    x[2, 0] = np.nan  # a NaN first: index 0, no count
    x[3, 700] = np.nan  # a NaN later: MLX's argmax takes it
    x[4] = -np.inf
    x[5, 3] = np.inf
    x[6, 10] = x[6].max() + 1
    x[6, 11] = x[6, 10] - GREEDY_TIE / 2  # a near-tie: counted
    x[7] = 0.0
    x[7, 4] = -0.0
    x[8, 0], x[8, 1:], x[8, 5] = -0.0, -1.0, 0.0
    x[9, 0], x[9, 2] = np.inf, np.nan
    x[10, 999] = 50.0  # the largest last
    x[11, 998] = np.nan
    x[12, 0] = 70.0  # the largest first
    logits = mx.array(x)
    cases = [logits, logits[:, ::3], logits[:, :17], logits[:, :1], logits[3:9, 5:900],
             mx.array(np.ascontiguousarray(x.T)).T]
    got = [greedy_candidates(case) for case in cases]  # the primitive (lazy)
    cpu_ops.disable()
    assert cpu_ops.greedy_candidates(logits, GREEDY_TIE) is None  # MLX's own ops from here
    expected = [greedy_candidates(case) for case in cases]
    cpu_ops.enable()
    for pair_got, pair_expected in zip(got, expected, strict=True):
        for a, b in zip(pair_got, pair_expected, strict=True):
            assert a.dtype == b.dtype and np.array_equal(np.array(a), np.array(b))
    top, near = greedy_candidates(logits)
    assert top.tolist()[:4] == [int(np.argmax(x[0])), 5, 0, 700]
    assert near.tolist()[:7] == [1, 2, 0, 0, 0, 0, 2]


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_real_model_decodes_bitwise_the_same(name, request):
    """SmolLM2 (Llama, GQA 3:1) and Gemma-3 (sliding-window masks, head size 256) decode with the
    primitive exactly as with MLX's own attention: the same tokens and bitwise the same
    log-probabilities at every step (the prompt's prefill included)."""
    model, tokenizer = request.getfixturevalue(name)
    prompt = mx.array(tokenizer.encode("The lighthouse keeper opened the bottle and read"))
    routes = blas.product_routes()
    ops_tokens, ops_logprobs = greedy_with_logprobs(model, prompt, 12)
    if routes is not None and blas.skinny_products().startswith("AVX"):
        assert blas.product_routes()["nn"] > routes["nn"]  # p v went to the shim's nn kernel
    cpu_ops.disable()
    tokens, logprobs = greedy_with_logprobs(model, prompt, 12)
    assert ops_tokens == tokens
    assert all(mx.array_equal(a, b).item() for a, b in zip(ops_logprobs, logprobs, strict=True))


def test_enable_swaps_mx_fast_and_disable_puts_mlx_own_back(monkeypatch):
    assert mx.fast.scaled_dot_product_attention is cpu_ops.scaled_dot_product_attention
    original = cpu_ops._state["reference"]
    cpu_ops.disable()
    assert mx.fast.scaled_dot_product_attention is original and not cpu_ops.enabled()
    assert cpu_ops.greedy_candidates(mx.zeros((1, 4)), GREEDY_TIE) is None
    monkeypatch.setenv("MLXSPEC_CPU_OPS", "0")
    assert cpu_ops.enable() is False and mx.fast.scaled_dot_product_attention is original
    assert "MLXSPEC_CPU_OPS=0" in cpu_ops.describe()
    monkeypatch.delenv("MLXSPEC_CPU_OPS")
    assert cpu_ops.enable() is True
    assert cpu_ops.describe().startswith("single ops")


CHECK = r"""
import json
import mlxspec
from mlxspec.cpu import ops as cpu_ops
import mlx.core as mx
enabled = cpu_ops.enable()
q = mx.ones((1, 2, 1, 8))
out = mx.fast.scaled_dot_product_attention(q, q, q, scale=1.0)
print(json.dumps({"enabled": enabled, "describe": cpu_ops.describe(), "out": out.tolist()}))
"""


def _run(code: str, **env: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_without_a_compiler_mlx_own_runs_and_doctor_says_why(tmp_path):
    report = _run(CHECK, MLXSPEC_HOME=str(tmp_path / "home"), CXX="/nonexistent/g++")
    assert report["enabled"] is False
    assert "no working C++ compiler" in report["describe"] and "CXX" in report["describe"]
    assert report["out"] == [[[[1.0] * 8], [[1.0] * 8]]]
    report = _run(CHECK, MLXSPEC_HOME="/proc/no-such-dir")
    assert report["enabled"] is False and "set MLXSPEC_HOME" in report["describe"]


@pytest.mark.parametrize("skinny", ["0", "avx2"])
def test_bitwise_with_other_blas_routes(skinny):
    """With the shim's kernels off (every product to OpenBLAS: one call per head) or AVX2 only,
    the primitive still makes MLX's own numbers."""
    code = r"""
import json
import numpy as np
import mlxspec
from mlxspec.cpu import ops as cpu_ops
import mlx.core as mx
assert cpu_ops.enable(), cpu_ops.describe()
own = cpu_ops._state["reference"]
same = []
for b, h, kv, lq, l, d in [(8, 9, 3, 1, 77, 64), (2, 9, 3, 5, 50, 64), (1, 8, 2, 30, 300, 128)]:
    q = mx.random.normal((b, h, lq, d)); k = mx.random.normal((b, kv, l, d))
    v = mx.random.normal((b, kv, l, d))
    mask = mx.arange(l)[None, None, None, :] >= mx.arange(b)[:, None, None, None]
    for m in (None, "causal", mask):
        a = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=m)
        same.append(np.array_equal(np.array(a), np.array(own(q, k, v, scale=0.1, mask=m))))
print(json.dumps({"same": same}))
"""
    report = _run(code, MLXSPEC_SKINNY=skinny)
    assert len(report["same"]) == 9 and all(report["same"])
