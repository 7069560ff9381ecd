"""The zero-point format: packing, dequantization and the lossless MLX affine form, against
independent numpy float64 references and MLX's own affine quantization."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxspec.errors import QuantizationError
from mlxspec.quant import zp_format

PACKABLE_BITS = (2, 3, 4, 5, 6, 8)


def bitstream_reference(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack by spelling out the bit stream: bit b of value i is stream bit i*bits + b."""
    rows, cols = q.shape
    words = -(-cols * bits // 32)
    stream = np.zeros((rows, words * 32), np.uint8)
    for b in range(bits):
        stream[:, np.arange(cols) * bits + b] = (q >> b) & 1
    return np.packbits(stream, axis=1, bitorder="little").view("<u4")


def random_layer(rng, n, k, bits, group_size):
    q = rng.integers(0, 2**bits, (n, k))
    z = rng.integers(0, 2**bits, (n, k // group_size))
    s = (rng.random((n, k // group_size)) * 0.05 + 1e-3).astype(np.float16)
    return q, z, s


def dense_reference(q, z, s, group_size) -> np.ndarray:
    """w = s * (q - z) in float64."""
    return np.repeat(s.astype(np.float64), group_size, 1) * (q - np.repeat(z, group_size, 1))


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from(PACKABLE_BITS),
    rows=st.integers(1, 3),
    cols=st.integers(1, 130),
    seed=st.integers(0, 2**32 - 1),
)
def test_pack_is_the_little_endian_bit_stream_and_unpack_inverts_it(bits, rows, cols, seed):
    q = np.random.default_rng(seed).integers(0, 2**bits, (rows, cols))
    packed = zp_format.pack(q, bits)
    assert packed.dtype == np.uint32 and packed.shape == (rows, zp_format.packed_cols(cols, bits))
    np.testing.assert_array_equal(packed, bitstream_reference(q, bits))
    unpacked = zp_format.unpack(packed, bits, cols)
    assert unpacked.dtype == np.uint8
    np.testing.assert_array_equal(unpacked, q)


@settings(max_examples=20, deadline=None)
@given(bits=st.sampled_from(PACKABLE_BITS), cols=st.integers(1, 100), seed=st.integers(0, 999))
def test_pack_and_unpack_give_the_same_words_for_mx_and_numpy(bits, cols, seed):
    q = np.random.default_rng(seed).integers(0, 2**bits, (2, cols))
    packed = zp_format.pack(mx.array(q), bits)
    assert isinstance(packed, mx.array) and packed.dtype == mx.uint32
    np.testing.assert_array_equal(np.array(packed), zp_format.pack(q, bits))
    np.testing.assert_array_equal(np.array(zp_format.unpack(packed, bits, cols)), q)


@pytest.mark.parametrize("bits", PACKABLE_BITS)
def test_packing_is_mlx_affine_packing(bits):
    """Values recovered from mx.quantize's output re-pack to the very same words."""
    w = mx.array(np.random.default_rng(bits).standard_normal((4, 256)).astype(np.float32))
    packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    dense = np.array(mx.dequantize(packed, scales, biases, group_size=32, bits=bits))
    q = np.rint((dense - np.repeat(np.array(biases), 32, 1)) / np.repeat(np.array(scales), 32, 1))
    np.testing.assert_array_equal(zp_format.unpack(np.array(packed), bits, 256), q)
    np.testing.assert_array_equal(zp_format.pack(q.astype(np.int64), bits), np.array(packed))


def test_worked_example_in_the_module_docstring():
    assert zp_format.pack([[3, 0, 15, 7, 8, 1, 2, 9]], 4)[0, 0] == 0x92187F03
    assert zp_format.pack([[6, 5]], 4)[0, 0] == 0x56
    assert "0x92187F03" in zp_format.__doc__ and "0x56" in zp_format.__doc__


def test_pack_rejects_values_that_do_not_fit():
    with pytest.raises(ValueError, match="out of range"):
        zp_format.pack([[16]], 4)
    with pytest.raises(ValueError, match="cannot pack"):
        zp_format.pack([[1]], 7)


@pytest.mark.parametrize("bits", zp_format.SUPPORTED_BITS)
@pytest.mark.parametrize("group_size", zp_format.SUPPORTED_GROUP_SIZES)
def test_dequantize_equals_float64_reference_rounded_once(bits, group_size):
    rng = np.random.default_rng(bits * group_size)
    q, z, s = random_layer(rng, 5, 3 * group_size, bits, group_size)
    weight, zeros = zp_format.pack(q, bits), zp_format.pack(z, bits)
    assert zeros.shape == (5, zp_format.packed_cols(3, bits))
    ref = dense_reference(q, z, s, group_size)
    out = zp_format.dequantize(weight, s, zeros, bits, group_size)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, ref.astype(np.float16))
    for dtype in (mx.float32, mx.float16):
        got = zp_format.dequantize(
            mx.array(weight), mx.array(s), mx.array(zeros), bits, group_size, dtype=dtype
        )
        np.testing.assert_array_equal(
            np.array(got), ref.astype(np.dtype(str(dtype).split(".")[-1]))
        )


def test_dequantize_with_bfloat16_scales_rounds_once_to_bfloat16():
    rng = np.random.default_rng(1)
    q, z, s = random_layer(rng, 4, 128, 4, 64)
    s_bf16 = mx.array(s.astype(np.float32)).astype(mx.bfloat16)
    s64 = np.array(s_bf16.astype(mx.float32)).astype(np.float64)
    ref = dense_reference(q, z, s64, 64)
    got = zp_format.dequantize(mx.array(zp_format.pack(q, 4)), s_bf16, mx.array(zp_format.pack(z, 4)), 4, 64)
    assert got.dtype == mx.bfloat16
    want = mx.array(ref.astype(np.float32)).astype(mx.bfloat16)  # float32 holds ref exactly
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("bits", zp_format.SUPPORTED_BITS)
@pytest.mark.parametrize("group_size", (32, 128))
def test_to_mlx_affine_is_exact_and_quantized_matmul_matches_float64(bits, group_size):
    rng = np.random.default_rng(bits + group_size)
    n, k = 24, 4 * group_size
    q, z, s = random_layer(rng, n, k, bits, group_size)
    ref = dense_reference(q, z, s, group_size)
    weight, scales, biases = zp_format.to_mlx_affine(
        mx.array(zp_format.pack(q, bits)),
        mx.array(s),
        mx.array(zp_format.pack(z, bits)),
        bits,
        group_size,
    )
    assert biases.dtype == mx.float32
    # The affine form reproduces every weight exactly.
    affine = mx.dequantize(
        weight, scales.astype(mx.float32), biases, group_size=group_size, bits=bits
    )
    np.testing.assert_array_equal(np.array(affine), ref.astype(np.float32))
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = mx.quantized_matmul(
        mx.array(x), weight, scales, biases, transpose=True, group_size=group_size, bits=bits
    )
    want = x.astype(np.float64) @ ref.T
    bound = 1e-6 * (np.abs(x) @ np.abs(ref).T) + 1e-30
    assert np.all(np.abs(np.array(y) - want) <= bound)


def test_float16_biases_round_within_the_documented_bound():
    rng = np.random.default_rng(7)
    q, z, s = random_layer(rng, 8, 256, 8, 64)
    _, _, b16 = zp_format.to_mlx_affine(
        zp_format.pack(q, 8), s, zp_format.pack(z, 8), 8, 64, bias_dtype=np.float16
    )
    exact = -s.astype(np.float64) * z
    assert np.all(np.abs(b16.astype(np.float64) - exact) <= np.abs(exact) * 2.0**-11)


def test_check_spec_raises_one_line_errors():
    zp_format.check_spec(4, 64, 576)
    for args, words in [
        ((5, 64, 576), "bits=5"),
        ((4, 48, 576), "group size 48"),
        ((4, 128, 576), "use group size 32 or 64"),
    ]:
        with pytest.raises(QuantizationError, match=words) as info:
            zp_format.check_spec(*args)
        assert "\n" not in str(info.value)


def test_dequantize_rejects_mismatched_arrays():
    weight = np.zeros((2, 8), np.uint32)  # 64 inputs at 4 bits
    with pytest.raises(QuantizationError, match="do not match"):
        zp_format.dequantize(weight, np.ones((2, 3), np.float16), np.zeros((2, 1), np.uint32), 4, 32)


def test_bits_per_weight_is_below_mlx_affine():
    assert zp_format.bits_per_weight(4, 64) == 4 + 20 / 64
    assert zp_format.bits_per_weight(4, 64) < 4 + 32 / 64  # MLX affine: float16 scale + bias
    assert zp_format.bits_per_weight(8, 128, scale_bits=16) == 8 + 24 / 128


# -- the exact affine form ---------------------------------------------------------------------

MX_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("bits", zp_format.SUPPORTED_BITS)
def test_exact_scales_make_mlx_dequantize_equal_s_times_q_minus_z_bit_for_bit(dtype, bits):
    # Scales from round_scales and the biases -s*z in the model's dtype: MLX's own dequantize
    # (which computes scale * q + bias in that dtype) gives s * (q - z) computed in float64 and
    # rounded once, for every weight; and z comes back exactly from the biases.
    rng = np.random.default_rng(bits)
    n, k, g = 16, 256, 64
    q, z, _ = random_layer(rng, n, k, bits, g)
    s = zp_format.round_scales(rng.random((n, k // g)) * 0.05 + 1e-4, bits, dtype)
    scales = mx.array(s).astype(MX_DTYPES[dtype])
    weight, zeros = mx.array(zp_format.pack(q, bits)), mx.array(zp_format.pack(z, bits))
    assert zp_format.scales_are_exact(scales, bits)
    _, _, biases = zp_format.to_mlx_affine(weight, scales, zeros, bits, g)
    assert biases.dtype == scales.dtype
    got = mx.dequantize(weight, scales, biases, group_size=g, bits=bits)
    assert got.dtype == scales.dtype
    want = mx.array(dense_reference(q, z, s, g).astype(np.float32)).astype(scales.dtype)
    assert mx.array_equal(got, want).item()
    assert mx.array_equal(got, zp_format.dequantize(weight, scales, zeros, bits, g)).item()
    np.testing.assert_array_equal(zp_format.zeros_from_affine(scales, biases, bits), z)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_unconstrained_scales_are_not_exact_in_mlx(dtype):
    # The canary: ordinary half-precision scales (what min-max rounding gives) are flagged, and
    # MLX's dequantize of the affine form in that dtype misses s * (q - z) for many weights.
    rng = np.random.default_rng(1)
    q, z, s = random_layer(rng, 16, 256, 4, 64)
    scales = mx.array(s.astype(np.float32) * 1.013).astype(MX_DTYPES[dtype])
    assert not zp_format.scales_are_exact(scales, 4)
    weight, zeros = mx.array(zp_format.pack(q, 4)), mx.array(zp_format.pack(z, 4))
    _, _, biases = zp_format.to_mlx_affine(weight, scales, zeros, 4, 64)
    assert biases.dtype == mx.float32  # the exact form then needs float32 biases
    got = mx.dequantize(weight, scales, biases.astype(scales.dtype), group_size=64, bits=4)
    want = zp_format.dequantize(weight, scales, zeros, 4, 64)
    assert mx.sum(got != want).item() > 0


def test_round_scales_keeps_the_documented_significant_bits():
    assert zp_format.scale_bits(4, "float16") == 7 and zp_format.scale_bits(8, "float16") == 3
    assert zp_format.scale_bits(4, "bfloat16") == 4 and zp_format.scale_bits(8, "bfloat16") == 1
    s = zp_format.round_scales(np.array([0.05, 1e-9]), 4, "float16")
    assert s[0] == 51 * 2.0**-10 and s[1] == 2.0**-14  # the worked example; the smallest normal
    assert zp_format.round_scales(np.array([0.05]), 4, "float16", up=True)[0] == 103 * 2.0**-11
    with pytest.raises(QuantizationError, match="float8"):
        zp_format.dtype_name("float8")


def test_zeros_from_affine_refuses_a_float_minimum():
    s = np.array([[0.5, 0.25]], np.float32)
    assert zp_format.zeros_from_affine(s, np.array([[-1.5, -0.5]], np.float32), 4).tolist() == [[3, 2]]
    assert zp_format.zeros_from_affine(s, np.array([[-1.3, -0.5]], np.float32), 4) is None
    assert zp_format.zeros_from_affine(s, np.array([[-8.0, 0.5]], np.float32), 4) is None  # z < 0
