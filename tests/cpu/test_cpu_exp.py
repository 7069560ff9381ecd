"""mlxspec.cpu.ops' exp, logsumexp and argmax: vectorized, bitwise MLX's own.

MLX's Linux build computes exp one element at a time through a software fma and scans argmax
one value at a time; the primitives run MLX's own exp vectorized, logsumexp in MLX's order,
argmax 16 lanes at a time. The references are MLX's own ops (bit for bit) and float64 numpy.
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlxspec import cpu
from mlxspec.cpu import ops as cpu_ops


@pytest.fixture(autouse=True)
def in_place():
    if shutil.which("g++") is None:
        pytest.skip("no g++: the primitives cannot be built here, MLX's own ops run instead")
    was_enabled = cpu_ops.enabled()
    assert cpu_ops.enable()
    yield
    if not was_enabled:
        cpu_ops.disable()


def mlx_logsumexp(x, **kwargs):
    return cpu_ops._state["logsumexp"](x, **kwargs)


def logits(shape, seed=0, scale=8.0) -> mx.array:
    return mx.array(scale * np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("shape", [(49152,), (1, 49152), (4, 3001), (2, 3, 257)])
def test_logsumexp_and_exp_are_bitwise_mlx_own(shape):
    x = logits(shape)
    ours = mx.logsumexp(x, axis=-1, keepdims=True)
    assert mx.array_equal(ours, mlx_logsumexp(x, axis=-1, keepdims=True)).item()
    assert mx.array_equal(cpu.exp(x), mx.exp(x)).item()
    x64 = np.array(x, dtype=np.float64)
    top = x64.max(-1, keepdims=True)
    expected = top + np.log(np.exp(x64 - top).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.array(ours), expected, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.array(cpu.exp(x)), np.exp(x64), rtol=2e-6)


def test_infinities_and_strided_rows_are_mlx_own():
    x = logits((3, 4000), seed=1)
    x[1, :] = -mx.inf  # a row a processor ruled out entirely
    x[2, 7] = mx.inf
    for rows in (x, x[:, ::3], x.T[::7].T):  # contiguous, strided, column-major
        assert mx.array_equal(mx.logsumexp(rows, -1), mlx_logsumexp(rows, axis=-1),
                              equal_nan=True).item()
        assert mx.array_equal(cpu.exp(rows), mx.exp(rows)).item()


def test_only_float32_over_the_last_axis_takes_the_primitive():
    def names(out):
        import io
        import re

        dot = io.StringIO()
        mx.export_to_dot(dot, out)
        return re.findall(r'label ="([A-Za-z]+)', dot.getvalue())

    x = logits((4, 300))
    assert "MlxspecCpuLogSumExp" in names(mx.logsumexp(x, axis=-1))
    assert "MlxspecCpuLogSumExp" in names(mx.logsumexp(x, axis=1, keepdims=True))
    for other in (mx.logsumexp(x, axis=0), mx.logsumexp(x), mx.logsumexp(x.astype(mx.float16), -1)):
        assert "MlxspecCpuLogSumExp" not in names(other)
    row = x[:1]  # mlx-lm's decoding: logits (1, vocab), every axis, keepdims
    for keepdims in (True, False):
        ours = mx.logsumexp(row, keepdims=keepdims)
        assert "MlxspecCpuLogSumExp" in names(ours)
        assert mx.array_equal(ours, mlx_logsumexp(row, keepdims=keepdims)).item()
        assert ours.shape == mlx_logsumexp(row, keepdims=keepdims).shape
    assert mx.logsumexp(x, axis=-1).shape == (4,)
    assert mx.array_equal(mx.logsumexp(x, axis=0), mlx_logsumexp(x, axis=0)).item()


def test_gradients_are_mlx_own():
    x, w = logits((3, 500), seed=2), logits((3,), seed=3)
    ours = mx.grad(lambda a: (mx.logsumexp(a, -1) * w).sum())(x)
    theirs = mx.grad(lambda a: (mlx_logsumexp(a, axis=-1) * w).sum())(x)
    assert mx.array_equal(ours, theirs).item()
    ours = mx.grad(lambda a: (cpu.exp(a) * x).sum())(x / 8)
    theirs = mx.grad(lambda a: (mx.exp(a) * x).sum())(x / 8)
    assert mx.array_equal(ours, theirs).item()


def test_vmap_and_forward_derivatives_are_mlx_own():
    """mx.logsumexp is replaced process-wide: MLX's vmap and jvp through it must still work
    (they raised 'not implemented'), whichever axis is mapped, with MLX's own numbers."""
    x, t = logits((5, 300), seed=4), logits((5, 300), seed=5)
    for axis in (0, 1):
        ours = mx.vmap(lambda a: mx.logsumexp(a, axis=-1), in_axes=axis)(x)
        theirs = mx.vmap(lambda a: mlx_logsumexp(a, axis=-1), in_axes=axis)(x)
        assert ours.shape == theirs.shape and mx.array_equal(ours, theirs).item()
        assert mx.array_equal(mx.vmap(cpu.exp, in_axes=axis)(x), mx.vmap(mx.exp, in_axes=axis)(x)).item()
    ours = mx.jvp(lambda a: mx.logsumexp(a, axis=-1), [x], [t])[1][0]
    theirs = mx.jvp(lambda a: mlx_logsumexp(a, axis=-1), [x], [t])[1][0]
    assert mx.array_equal(ours, theirs).item()
    ours = mx.jvp(cpu.exp, [x / 8], [t])[1][0]
    assert mx.array_equal(ours, mx.jvp(mx.exp, [x / 8], [t])[1][0]).item()


def test_a_shapeless_compile_replayed_on_more_rows_sums_them_all():
    """mx.logsumexp(a) over every axis, traced on one row (mlx-lm's decoding) by a shapeless
    mx.compile, then replayed on two rows: MLX's own answer (the trace reshaped the row's result
    to () and failed; with keepdims it gave one value a row)."""
    x = logits((2, 300), seed=6)
    for keepdims in (False, True):
        compiled = mx.compile(lambda a, k=keepdims: mx.logsumexp(a, keepdims=k), shapeless=True)
        assert mx.array_equal(compiled(x[:1]), mlx_logsumexp(x[:1], keepdims=keepdims)).item()
        got, expected = compiled(x), mlx_logsumexp(x, keepdims=keepdims)
        assert got.shape == expected.shape
        np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-6)


def test_disable_puts_mlx_own_back():
    original = cpu_ops._state["logsumexp"]
    cpu_ops.disable()
    assert mx.logsumexp is original
    assert cpu_ops.enable() and mx.logsumexp is cpu_ops.logsumexp


def test_argmax_is_mlx_own_with_ties_nans_and_infinities():
    x = logits((6, 49152), seed=4)
    x[1, 5] = x[1, 900] = 100.0  # a tie: the first
    x[2, 4000] = mx.nan  # a NaN: MLX's argmax answers it
    x[3, :] = -mx.inf
    x[4, 77] = mx.inf
    for rows in (x, x[2], x.reshape(2, 3, 49152), x[:, ::5], x.astype(mx.float16)):
        ours, theirs = cpu.argmax(rows), mx.argmax(rows, axis=-1)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert mx.array_equal(ours, theirs).item()


def test_argmax_maps_like_mlx_own():
    """mx.vmap over the greedy sampler (mlxspec.cpu.argmax), mapping either axis of (rows, vocab)
    or the middle one of (2, rows, vocab): MLX's argmax's answer (it raised 'not implemented')."""
    x = logits((3, 4, 257), seed=7)
    for axis in (0, 1):
        ours = mx.vmap(cpu.argmax, in_axes=axis)(x[0])
        assert mx.array_equal(ours, mx.vmap(lambda a: mx.argmax(a, -1), in_axes=axis)(x[0])).item()
    ours = mx.vmap(cpu.argmax, in_axes=1)(x)
    assert mx.array_equal(ours, mx.vmap(lambda a: mx.argmax(a, -1), in_axes=1)(x)).item()
