"""mlxspec.cpu.ops' RMSNorm: one op for float32, bitwise MLX's own fallback.

References: MLX's own ``mx.fast.rms_norm`` (bit for bit) and a float64 numpy RMSNorm (closely).
"""

from __future__ import annotations

import io
import re

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.cpu import fused_ops

pytestmark = pytest.mark.usefixtures("primitives_in_place")


def op_names(out: mx.array) -> list[str]:
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    return re.findall(r'label ="([A-Za-z]+)', dot.getvalue())


def mlx_rms_norm(x, w, eps):
    return fused_ops._reference["rms_norm"](x, w, eps)


@pytest.mark.parametrize(("shape", "transposed", "eps"), [
    ((1, 1, 576), False, 1e-5),  # a decode step
    ((2, 9, 576), False, 1e-6),  # a verification of 8 drafts, two streams
    ((3, 5, 640), True, 1e-6),  # rows not contiguous with each other
    ((7, 64), False, 1e-5),
])
def test_rms_norm_is_bitwise_mlx_own(shape, transposed, eps):
    rng = np.random.default_rng(0)
    x = mx.array((3 * rng.standard_normal(shape)).astype(np.float32))
    x = x.swapaxes(0, 1) if transposed else x
    w = mx.array(rng.standard_normal(shape[-1]).astype(np.float32))
    ours = mx.fast.rms_norm(x, w, eps)
    assert "MlxspecCpuRmsNorm" in op_names(ours)
    assert mx.array_equal(ours, mlx_rms_norm(x, w, eps)).item()
    x64, w64 = np.array(x, dtype=np.float64), np.array(w, dtype=np.float64)
    expected = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w64
    np.testing.assert_allclose(np.array(ours), expected, rtol=1e-5, atol=1e-5)


def test_other_dtypes_take_the_compiled_graph_and_gradients_are_mlx_own():
    x = mx.random.normal((2, 3, 64), key=mx.random.key(1))
    w = mx.random.normal((64,), key=mx.random.key(2))
    half = mx.fast.rms_norm(x.astype(mx.float16), w.astype(mx.float16), 1e-5)
    assert "MlxspecCpuRmsNorm" not in op_names(half)
    assert mx.array_equal(half, mlx_rms_norm(x.astype(mx.float16), w.astype(mx.float16), 1e-5)).item()
    ours = mx.grad(lambda a, b: (mx.fast.rms_norm(a, b, 1e-5) * x).sum(), argnums=(0, 1))(x, w)
    theirs = mx.grad(lambda a, b: (mlx_rms_norm(a, b, 1e-5) * x).sum(), argnums=(0, 1))(x, w)
    for a, b in zip(ours, theirs, strict=True):
        assert mx.array_equal(a, b).item()
