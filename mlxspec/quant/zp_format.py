"""The mlxspec zero-point weight format: the one definition, used by the quantizers, the layers,
the saver/loader, the Metal kernels (``metal/*.metal``) and the MLX fallback.

A linear layer's weight ``W`` of shape ``(out_features, in_features)`` is cut into groups of
``group_size`` (g) consecutive weights along ``in_features``. Each group has a scale ``s`` (float16
or bfloat16) and an integer zero-point ``z`` in ``[0, 2**bits - 1]``; each weight is an unsigned
``bits``-bit integer ``q`` and stands for

    w = s * (q - z)

Three arrays hold a layer (n_groups = in_features / g):

- ``weight``: uint32 ``(out_features, in_features * bits / 32)``, the ``q`` packed along each row;
- ``scales``: float16 or bfloat16 ``(out_features, n_groups)``;
- ``zeros``:  uint32 ``(out_features, ceil(n_groups * bits / 32))``, the ``z`` packed the same way
  along the group axis (the last word padded with zero bits).

Packing: each row is one little-endian bit stream; element ``i`` occupies bits ``i*bits`` to
``i*bits + bits - 1`` of the stream, i.e. bit ``(i*bits) % 32`` onward of word ``(i*bits) // 32``
(for 3 bits an element may run into the next word). For 2, 4 and 8 bits this is "element ``i`` of a
word at bits ``(i % (32/bits)) * bits``". It is exactly MLX's affine packing, so ``weight`` is
shared unchanged with ``mx.quantized_matmul``. Every 8 consecutive elements fill exactly ``bits``
bytes (a "pack", the kernels' unit) and every 32 exactly ``bits`` words; a group is a whole number
of both.

Storage of the zero-point form: ``bits + (16 + bits) / g`` bits per weight, against MLX affine's
``bits + 32 / g`` (a float16 bias costs 16 bits a group, a zero-point ``bits``): at 4 bits, g=64,
4.31 against 4.5. See :func:`bits_per_weight`.

Worked example (bits=4, g=32, one row of 64 weights, so two groups). Group 0 has s=0.05, z=6; its
first eight weights ``[-0.15, -0.30, 0.45, 0.05, 0.10, -0.25, -0.20, 0.15]`` are
``q = w/s + z = [3, 0, 15, 7, 8, 1, 2, 9]``, packed into word 0 as
``3 | 0<<4 | 15<<8 | 7<<12 | 8<<16 | 1<<20 | 2<<24 | 9<<28 = 0x92187F03``. The row's 64 weights take
8 words; ``scales`` is ``[0.05, s1]`` and with group 1's zero-point ``z1 = 5`` the zeros row is one
word ``6 | 5<<4 = 0x56``.

Exact MLX affine form (the default output, ``--format mlx``). MLX stores ``w = scale * q + bias``
with ``scale`` and ``bias`` in the model's dtype ``T`` and computes it in ``T``. With ``bias = -s*z``
that is bit-exact ``s * (q - z)`` -- and ``z = -bias / scale`` is recovered exactly -- when ``s`` has
at most ``max(1, p - bits)`` significant bits (``p``: ``T``'s precision, 11 for float16, 8 for
bfloat16, 24 for float32) and is a normal number: then ``s*q``, ``s*z`` and ``s*(q - z)`` all fit
in ``T``, whatever the order of evaluation (:func:`round_scales`, :func:`scales_are_exact`). The
quantizers search only such scales: 7 significant bits at 4 bits in float16, 3 at 8 bits; 4 at
4 bits in bfloat16, a power of two at 8 bits. Example: s = 0.05 (float16 0.0500030517578125,
11 significant bits) is not exact at 4 bits; :func:`round_scales` makes it ``51 * 2**-10 =
0.0498046875``, and with z = 6 the bias ``-0.298828125`` and every ``s*q`` are exact float16 values.
Storage: ``bits + 32 / g`` bits per weight, exactly mlx-lm's.

Zero-point form (``--format zp``, for what cannot be made exact: imported GPTQ/AWQ checkpoints with
arbitrary float16 scales, act-order): ``weight``, ``scales`` and packed integer ``zeros``; read by
mlxspec only. :func:`to_mlx_affine` of such a layer needs float32 biases to stay exact.

Every function takes numpy or ``mx`` arrays and returns the same kind (numpy for tests and files,
``mx`` at run time); numpy has no bfloat16, so bfloat16 scales need ``mx`` arrays.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from mlxspec.errors import QuantizationError

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
BLOCK = 32  # elements per block: 32 elements of b bits fill exactly b uint32 words
# Significant bits (precision p) and smallest normal number of each scale dtype.
PRECISION = {"float16": (11, 2.0**-14), "bfloat16": (8, 2.0**-126), "float32": (24, 2.0**-126)}
DTYPES = tuple(PRECISION)


def check_spec(bits: int, group_size: int, in_features: int) -> None:
    """Raise QuantizationError (one line) unless (bits, group_size) can quantize ``in_features``."""
    if bits not in SUPPORTED_BITS:
        raise QuantizationError(
            f"unsupported bits={bits}: choose one of {', '.join(map(str, SUPPORTED_BITS))}"
        )
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise QuantizationError(
            f"unsupported group size {group_size}: choose one of "
            f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))}"
        )
    if in_features % group_size:
        fits = [g for g in SUPPORTED_GROUP_SIZES if in_features % g == 0]
        hint = f"use group size {' or '.join(map(str, fits))}" if fits else "keep it unquantized"
        raise QuantizationError(
            f"in_features={in_features} is not a multiple of group size {group_size}: {hint}"
        )


def packed_cols(cols: int, bits: int) -> int:
    """Number of uint32 words that hold ``cols`` packed ``bits``-bit values."""
    return math.ceil(cols * bits / 32)


def bits_per_weight(bits: int, group_size: int, scale_bits: int = 16) -> float:
    """Storage cost in bits per weight: ``bits + (scale_bits + bits) / group_size``."""
    return bits + (scale_bits + bits) / group_size


def dtype_name(dtype) -> str:
    """``"float16"``, ``"bfloat16"`` or ``"float32"`` for a name, an mx dtype or a numpy dtype."""
    name = str(dtype).split(".")[-1]
    if name not in PRECISION:
        raise QuantizationError(f"unsupported dtype {name}: choose {', '.join(DTYPES)}")
    return name


def scale_bits(bits: int, dtype) -> int:
    """Significant bits a scale may have for ``s*q`` and ``s*z`` to be exact in ``dtype``."""
    return max(1, PRECISION[dtype_name(dtype)][0] - bits)


def round_scales(s, bits: int, dtype, *, up: bool = False) -> np.ndarray:
    """Scales rounded to nearest (``up``: upward) with :func:`scale_bits` significant bits, at
    least the dtype's smallest normal number: float32 numpy values, each exactly representable in
    ``dtype`` and making the affine form of ``bits``-bit weights exact (module docstring).

    Args:
        s: positive float scales (numpy), any shape.
    """
    precision, smallest = PRECISION[dtype_name(dtype)]
    k = scale_bits(bits, dtype)
    m, e = np.frexp(np.maximum(np.asarray(s, np.float64), smallest))  # s = m * 2**e, m in [.5, 1)
    rounded = np.ldexp((np.ceil if up else np.rint)(np.ldexp(m, k)), e - k)
    return rounded.astype(np.float32)


def scales_are_exact(scales, bits: int) -> bool:
    """True if every scale (in its own dtype) keeps the affine form of ``bits``-bit weights exact."""
    dtype = scales.dtype
    s = np.array(scales.astype(mx.float32) if isinstance(scales, mx.array) else scales, np.float64)
    precision, smallest = PRECISION[dtype_name(dtype)]
    m, e = np.frexp(s)
    k = scale_bits(bits, dtype)
    return bool(np.all(s >= smallest) and np.all(np.ldexp(m, k) == np.rint(np.ldexp(m, k))))


def zeros_from_affine(scales, biases, bits: int):
    """The integer zero-points ``z = -bias / scale`` of an affine layer, or None.

    Args:
        scales, biases: ``(out, n_groups)`` arrays (numpy or mx), any float dtype.

    Returns:
        uint8 numpy ``(out, n_groups)`` if every ``z`` is an integer in ``[0, 2**bits)`` with
        ``scale * z == -bias`` exactly; else None (e.g. GGUF Q4_1's float minimum: keep the layer
        as MLX affine).
    """
    s = np.array(scales.astype(mx.float32) if isinstance(scales, mx.array) else scales, np.float64)
    b = np.array(biases.astype(mx.float32) if isinstance(biases, mx.array) else biases, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.rint(-b / s)
    if not np.all(np.isfinite(z)) or np.any(z < 0) or np.any(z >= 2**bits) or np.any(s * z != -b):
        return None
    return z.astype(np.uint8)


def _xp(a):
    """The array module of ``a``: mlx.core for mx arrays, numpy for everything else."""
    return mx if isinstance(a, mx.array) else np


def _to_array(a):
    return a if isinstance(a, (mx.array, np.ndarray)) else np.asarray(a)


def _pad_last(a, n: int):
    """Pad the last axis of ``a`` with ``n`` zeros."""
    if n == 0:
        return a
    widths = [(0, 0)] * (a.ndim - 1) + [(0, n)]
    return _xp(a).pad(a, widths)


# At 2, 4 and 8 bits no value straddles a byte, so the little-endian bit stream is a byte stream:
# numpy packs the bytes and views them as words (Gemma-3's 262k x 640 table at 4 bits: packing
# 6x, unpacking 23x faster than the word-by-word loop).
_BYTE_ALIGNED = (2, 4, 8)


def _pack_bytes(q: np.ndarray, bits: int) -> np.ndarray:
    per_byte = 8 // bits
    q = _pad_last(q.astype(np.uint8), -q.shape[-1] % BLOCK)
    parts = q.reshape(*q.shape[:-1], -1, per_byte)
    stream = parts[..., 0].copy()
    for i in range(1, per_byte):
        stream |= parts[..., i] << np.uint8(i * bits)
    return stream.view("<u4").astype(np.uint32, copy=False)  # stream: a fresh contiguous array


def _unpack_bytes(packed: np.ndarray, bits: int) -> np.ndarray:
    stream = np.ascontiguousarray(packed.astype("<u4", copy=False)).view(np.uint8)
    per_byte = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    parts = [(stream >> np.uint8(i * bits)) & mask for i in range(per_byte)]
    return np.stack(parts, axis=-1).reshape(*stream.shape[:-1], -1)


def pack(q, bits: int):
    """Pack unsigned ``bits``-bit integers along the last axis (the layout in the module docstring).

    Args:
        q: integer array ``(..., cols)`` with values in ``[0, 2**bits)``.
        bits: one of 2, 3, 4, 5, 6, 8.

    Returns:
        uint32 array ``(..., ceil(cols * bits / 32))``; padding bits are zero.
    """
    q = _to_array(q)
    xp = _xp(q)
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"cannot pack {bits}-bit values")
    cols = q.shape[-1]
    if q.size and (int(q.min()) < 0 or int(q.max()) >= 2**bits):
        raise ValueError(f"values out of range for {bits} bits: [{int(q.min())}, {int(q.max())}]")
    if xp is np and bits in _BYTE_ALIGNED:
        return _pack_bytes(q, bits)[..., : packed_cols(cols, bits)]
    q = _pad_last(q.astype(xp.uint32), -cols % BLOCK)
    blocks = q.reshape(*q.shape[:-1], -1, BLOCK)
    words = [xp.zeros(blocks.shape[:-1], dtype=xp.uint32) for _ in range(bits)]
    for i in range(BLOCK):
        word, shift = divmod(i * bits, 32)
        words[word] = words[word] | (blocks[..., i] << shift)
        if shift + bits > 32:  # the value runs into the next word (3, 5, 6 bits)
            words[word + 1] = words[word + 1] | (blocks[..., i] >> (32 - shift))
    packed = xp.stack(words, axis=-1).reshape(*q.shape[:-1], -1)
    return packed[..., : packed_cols(cols, bits)]


def unpack(packed, bits: int, cols: int):
    """Inverse of :func:`pack`: uint32 ``(..., words)`` -> uint8 ``(..., cols)``."""
    packed = _to_array(packed)
    xp = _xp(packed)
    if packed.shape[-1] < packed_cols(cols, bits):
        raise ValueError(f"{packed.shape[-1]} words cannot hold {cols} values of {bits} bits")
    if xp is np and bits in _BYTE_ALIGNED:
        return _unpack_bytes(packed[..., : packed_cols(cols, bits)], bits)[..., :cols]
    packed = packed[..., : packed_cols(cols, bits)].astype(xp.uint32)
    packed = _pad_last(packed, -packed.shape[-1] % bits)
    blocks = packed.reshape(*packed.shape[:-1], -1, bits)
    mask = (1 << bits) - 1
    values = []
    for i in range(BLOCK):
        word, shift = divmod(i * bits, 32)
        v = blocks[..., word] >> shift
        if shift + bits > 32:
            v = v | (blocks[..., word + 1] << (32 - shift))
        values.append(v & mask)
    q = xp.stack(values, axis=-1).reshape(*packed.shape[:-1], -1)
    return q[..., :cols].astype(xp.uint8)


def _check_shapes(weight, scales, zeros, bits: int, group_size: int) -> int:
    """Check the three arrays agree; return in_features."""
    in_features = weight.shape[-1] * 32 // bits
    check_spec(bits, group_size, in_features)
    n_groups = in_features // group_size
    if scales.shape[-1] != n_groups or zeros.shape[-1] != packed_cols(n_groups, bits):
        raise QuantizationError(
            f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not match weight "
            f"{tuple(weight.shape)} at bits={bits}, group size {group_size}: the checkpoint is corrupt"
        )
    return in_features


def dequantize(weight, scales, zeros, bits: int, group_size: int, dtype=None):
    """Unpack to a dense weight ``w = s * (q - z)``.

    Args:
        weight: uint32 ``(out, in * bits / 32)``; scales ``(out, in / g)`` float16/bfloat16;
            zeros uint32 ``(out, ceil(in / g * bits / 32))``.
        dtype: output dtype (default: the scales' dtype).

    Returns:
        ``(out, in)`` array of ``dtype``. The product is formed in float32, where it is exact
        (at most 11 + 8 significant bits), and rounded once to ``dtype``: the same numbers as the
        Metal dequantize kernel and as a float64 reference rounded to ``dtype``.
    """
    weight, scales, zeros = _to_array(weight), _to_array(scales), _to_array(zeros)
    xp = _xp(weight)
    in_features = _check_shapes(weight, scales, zeros, bits, group_size)
    n_groups = in_features // group_size
    q = unpack(weight, bits, in_features).astype(xp.float32)
    z = unpack(zeros, bits, n_groups).astype(xp.float32)
    s = scales.astype(xp.float32)
    q = q.reshape(*q.shape[:-1], n_groups, group_size)
    w = s[..., None] * (q - z[..., None])
    return w.reshape(*w.shape[:-2], in_features).astype(dtype or scales.dtype)


def to_mlx_affine(weight, scales, zeros, bits: int, group_size: int, bias_dtype=None):
    """Convert to MLX affine form for ``mx.quantized_matmul`` / mlx-lm ``QuantizedLinear``.

    MLX computes ``w = scale * q + bias``; here ``scale = s`` and ``bias = -s * z``. The packed
    weight is reused unchanged (same bit layout).

    Args:
        bias_dtype: dtype of the biases. The default is the exact one: the scales' dtype when the
            scales are exact (:func:`scales_are_exact`; then ``bias`` and every ``scale * q + bias``
            are exact in that dtype), else float32 (``s*q + bias == s*(q - z)`` in float32, and
            ``mx.quantized_matmul`` then returns float32).

    Returns:
        ``(weight, scales, biases)``: weight as given, scales as given, biases ``(out, in / g)``.
    """
    weight, scales, zeros = _to_array(weight), _to_array(scales), _to_array(zeros)
    xp = _xp(weight)
    in_features = _check_shapes(weight, scales, zeros, bits, group_size)
    z = unpack(zeros, bits, in_features // group_size).astype(xp.float32)
    biases = -scales.astype(xp.float32) * z
    if bias_dtype is None:
        bias_dtype = scales.dtype if scales_are_exact(scales, bits) else xp.float32
    return weight, scales, biases.astype(bias_dtype)
