"""mlxspec.cpu.ops' RoPE rotation: one op per RoPE call of a decode step, bitwise MLX's own.

A cached forward's RoPE calls take the tables mlxspec.cpu.fused_ops builds once per position and
rotate with the primitive. The reference is MLX's own ``mx.fast.rope`` (bit for bit) and a
float64 numpy rotation (closely), as in tests/cpu/test_fused_ops.py.
"""

from __future__ import annotations

import io
import re

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.cpu import fused_ops
from tests.cpu.test_fused_ops import numpy_rope

pytestmark = pytest.mark.usefixtures("primitives_in_place")


def op_names(*outputs: mx.array) -> list[str]:
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return re.findall(r'label ="([A-Za-z]+)', dot.getvalue())


def mlx_rope(x, dims, **kwargs):
    return fused_ops._reference["rope"](x, dims, **kwargs)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(
    ("shape", "dims", "transposed"),
    [
        ((1, 9, 1, 64), 64, False),  # a decode step's queries
        ((1, 9, 4, 64), 64, True),  # a verification's queries, (B, T, H, D) viewed as (B, H, T, D)
        ((2, 3, 5, 64), 32, False),  # half the dims rotated, the rest copied
        ((3, 2, 7, 128), 128, True),
    ],
)
def test_rotation_is_bitwise_mlx_own(shape, dims, transposed, traditional):
    rng = np.random.default_rng(1)
    b, h, t, d = shape
    x = mx.array(rng.standard_normal((b, t, h, d) if transposed else shape).astype(np.float32))
    x = x.transpose(0, 2, 1, 3) if transposed else x
    kwargs = dict(traditional=traditional, base=10000.0, scale=1.0, offset=517)
    ours = fused_ops.rope(x, dims, **kwargs)
    assert "MlxspecCpuRope" in op_names(ours)
    assert mx.array_equal(ours, mlx_rope(x, dims, **kwargs)).item()
    expected = numpy_rope(np.array(x).astype(np.float64), dims, traditional, 10000.0, 1.0,
                          np.full(b, 517))
    # MLX's angles are float32: position 517 x a frequency near 1 is off by up to ~3e-5 rad
    np.testing.assert_allclose(np.array(ours), expected, atol=2e-4, rtol=1e-4)


def test_one_step_builds_the_tables_once_and_rotates_with_one_op_each():
    kwargs = dict(traditional=False, base=100000.0, scale=1.0, offset=1001)
    q, k = mx.ones((1, 9, 1, 64)), mx.ones((1, 3, 1, 64))
    fused_ops.rope(q, 64, **kwargs)  # the step's first call builds the tables
    second = fused_ops.rope(k, 64, **kwargs)
    names = op_names(second)
    assert names.count("MlxspecCpuRope") == 1 and "Cos" in names  # tables not yet computed
    mx.eval(second)
    assert op_names(fused_ops.rope(q, 64, **kwargs)).count("Cos") == 0  # computed: kept


def test_other_inputs_rotate_with_mlx_ops_bitwise():
    kwargs = dict(traditional=False, base=10000.0, scale=1.0, offset=33)
    for x in (mx.ones((1, 9, 1, 64), mx.float16) * 0.3, mx.ones((2, 3, 64)) * 0.7):
        ours = fused_ops.rope(x, 64, **kwargs)
        assert "MlxspecCpuRope" not in op_names(ours)
        assert mx.array_equal(ours, mlx_rope(x, 64, **kwargs)).item()


@pytest.mark.parametrize("traditional", [False, True])
def test_gradients_match_mlx_own(traditional):
    x = mx.random.normal((1, 4, 3, 64), key=mx.random.key(5))
    kwargs = dict(traditional=traditional, base=10000.0, scale=1.0, offset=9)
    weights = mx.random.normal(x.shape, key=mx.random.key(6))

    def loss(rope):
        return lambda a: (rope(a, 64, **kwargs) * weights).sum()

    ours = mx.grad(loss(fused_ops.rope))(x)
    reference = mx.grad(loss(mlx_rope))(x)
    np.testing.assert_allclose(np.array(ours), np.array(reference), atol=1e-5, rtol=1e-5)
