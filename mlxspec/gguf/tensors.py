"""GGUF quantized tensors imported as MLX quantized weights, without requantizing.

Four llama.cpp block types are MLX affine layouts at group size 32 with float16 scales and biases
(the GGUF file's own float16 numbers, so the import is bit-exact: MLX's ``scale * q + bias``,
computed in float32, equals llama.cpp's float32 dequantization):

    type   block (32 weights)                        w            MLX scale, bias      bits
    Q4_0   d f16, 16 bytes of nibbles                d * (q - 8)   d, -8 d (exact)      4
    Q4_1   d f16, m f16, 16 bytes of nibbles         d * q + m     d, m                 4
    Q5_0   d f16, 4 bytes of 5th bits, 16 of nibbles d * (q - 16)  d, -16 d (exact)     5
    Q8_0   d f16, 32 int8                            d * q         d, -128 d (exact)    8

Nibble order in a block: byte ``j`` holds weight ``j`` (low nibble) and ``j + 16`` (high nibble);
Q5_0's 5th bit of weight ``j`` is bit ``j`` of the little-endian uint32 ``qh``. Q4_0, Q5_0 and
Q8_0 have an integer zero-point (8, 16, 128), so mlxspec also runs them with its zero-point layers
(:func:`mlxspec.quant.storage.adopt_zero_points`); Q4_1's float minimum stays MLX affine.

Q4_K (super-blocks of 256: float16 ``d``, ``dmin``, eight 6-bit sub-block scales ``sc`` and minima
``m``) is MLX affine at group 32 with **float32** scales ``d * sc`` and biases ``-dmin * m`` (both
exact in float32: 11 + 6 significant bits), 6 bits per weight instead of GGUF's 4.5: still exact.
Other K-quants are dequantized, and the conversion says so in ``config.json``
(``quantization.dequantized``): Q6_K's 16-weight sub-blocks have no MLX group size.

Where quantized weights pay depends on the device (:func:`import_mode`): on Metal the quantized
matmuls are the fast path; on a CPU, where mlxspec's packed-weight kernel runs (Linux x86-64 with
AVX2) and a decode product on it measured faster than on a float32 copy through BLAS, once per
machine (``mlxspec.cpu.packed_weights_pay``; ``mlxspec doctor`` shows the numbers); without it
MLX's quantized matmul does not use BLAS and a dense float32 matrix through OpenBLAS is faster,
so the GGUF is dequantized there. ``MLXSPEC_GGUF_WEIGHTS`` (``auto``, ``dense``, ``quantized``)
overrides the choice.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K as GGUFQ4K

from mlxspec.errors import UnsupportedModelError
from mlxspec.progress import progress_bar
from mlxspec.quant import zp_format

MODE_ENV = "MLXSPEC_GGUF_WEIGHTS"  # "auto" (default), "dense" or "quantized"
GROUP_SIZE = 32
IMPORTED = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q8_0: 8, Q.Q4_K: 4}  # block type -> bits
# MLX's quantized layers compute in their scales' dtype (``nn.QuantizedEmbedding`` returns rows in
# it, ``QuantizedLinear`` promotes x to it): with the GGUF's float16 scales on the embedding table,
# plain mlx-lm would run the whole residual stream in float16, where Gemma-3's activations lose
# their precision (logits 15.7 off against a float64 reference with a spread of 5.8). llama.cpp
# computes in float32, so the table (and an untied output head, whose logits would be float16)
# keep float32 scales and biases: the same numbers, 2 more bytes per group of 32 on these two.
STREAM_ENDS = ("model.embed_tokens", "lm_head")


def import_mode() -> str:
    """``"quantized"`` (GGUF blocks kept as MLX quantized weights) or ``"dense"`` (dequantized
    to the conversion dtype), from ``MLXSPEC_GGUF_WEIGHTS`` or the device: quantized on Metal,
    and on a CPU where mlxspec's packed kernel measured faster than float32 + BLAS (once per
    machine, :func:`mlxspec.cpu.packed_weights_pay`), else dense (module docstring)."""
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "dense", "quantized"):
        raise UnsupportedModelError(f"{MODE_ENV}={value!r}: choose auto, dense or quantized")
    if value != "auto":
        return value
    if mx.metal.is_available():
        return "quantized"
    from mlxspec import cpu

    return "quantized" if cpu.packed_weights_pay()[0] else "dense"


def packed_bits() -> tuple[int, ...]:
    """Bit widths a quantized import keeps packed: every one of :data:`IMPORTED`'s on Metal or
    with ``MLXSPEC_GGUF_WEIGHTS=quantized``; on a CPU's own choice only those mlxspec's kernel
    multiplies (Q5_0 as a float32 copy: MLX's CPU 5-bit product made Gemma-3's 700-token
    prefill 9x slower than float32 through BLAS)."""
    if mx.metal.is_available() or os.environ.get(MODE_ENV, "").strip().lower() == "quantized":
        return tuple(sorted(set(IMPORTED.values())))
    from mlxspec import cpu

    return cpu.packed_bits()


@contextlib.contextmanager
def dense_conversion():
    """Within the block, GGUF files convert to dense float weights whatever the device: for
    flows that need a float source (``mlxspec quantize model.gguf`` on a Mac)."""
    saved = os.environ.get(MODE_ENV)
    os.environ[MODE_ENV] = "dense"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(MODE_ENV, None)
        else:
            os.environ[MODE_ENV] = saved


def describe() -> str:
    """One line for ``mlxspec doctor``: how GGUF files are converted on this machine."""
    mode = import_mode()
    if os.environ.get(MODE_ENV, "auto").strip().lower() not in ("", "auto"):
        why = f"{MODE_ENV}={os.environ[MODE_ENV]}"
    elif mx.metal.is_available():
        why = "Metal: quantized matmuls are the fast path"
    else:
        from mlxspec import cpu

        ms = cpu.packed_weights_pay()[1]
        why = (f"CPU, measured here: a decode product {ms['packed_ms']:.3f} ms packed against "
               f"{ms['dense_ms']:.3f} ms float32 + BLAS" if ms else
               "CPU without mlxspec's packed-weight kernel: float32 through BLAS is faster")
    if mode == "dense":
        return f"GGUF weights: dense ({why}); every type dequantized"
    kept = packed_bits()
    kinds = ", ".join(t.name for t, bits in IMPORTED.items() if bits in kept)
    return (f"GGUF weights: quantized ({why}); {kinds} import bit-exact as MLX quantized, "
            "the other types dequantized")


def _blocks(raw: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    """``(rows, bytes per row)`` uint8 -> ``(rows, blocks, block_bytes)``."""
    return raw.reshape(rows, -1, block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry (last axis) -> float16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``(..., 16)`` bytes -> ``(..., 32)`` values: low nibbles are weights 0-15, high 16-31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def affine_arrays(qtype: Q, raw: np.ndarray, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """One GGUF matrix as MLX affine arrays.

    Args:
        qtype: one of :data:`IMPORTED`.
        raw: the tensor's bytes, ``(rows, bytes per row)`` uint8.
        shape: ``(rows, columns)`` of the matrix.

    Returns:
        ``{"weight": uint32 (rows, columns * bits / 32), "scales": float16 (rows, columns / 32),
        "biases": float16 (rows, columns / 32)}`` (float32 scales and biases for Q4_K; also for
        the embedding table and output head once :func:`save_weights` writes them) with
        ``w = scales * q + biases`` per group.
    """
    rows, cols = shape
    if qtype == Q.Q4_0:
        b = _blocks(raw, rows, 18)
        d, q = _f16(b[..., 0:2]), _nibbles(b[..., 2:])
        biases = d * np.float16(-8)
    elif qtype == Q.Q4_1:
        b = _blocks(raw, rows, 20)
        d, biases, q = _f16(b[..., 0:2]), _f16(b[..., 2:4]), _nibbles(b[..., 4:])
    elif qtype == Q.Q5_0:
        b = _blocks(raw, rows, 22)
        d = _f16(b[..., 0:2])
        qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")[..., 0]
        high = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
        q = _nibbles(b[..., 6:]) | (high.astype(np.uint8) << 4)
        biases = d * np.float16(-16)
    elif qtype == Q.Q8_0:
        b = _blocks(raw, rows, 34)
        d = _f16(b[..., 0:2])
        q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        biases = d * np.float16(-128)
    elif qtype == Q.Q4_K:
        b = _blocks(raw, rows, 144)  # d, dmin, 12 bytes of 6-bit sc/m, 128 bytes of nibbles
        d, dmin = _f16(b[..., 0:2]).astype(np.float32), _f16(b[..., 2:4]).astype(np.float32)
        sc, m = GGUFQ4K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
        d = d[..., None] * sc.reshape(*d.shape, 8).astype(np.float32)  # (rows, blocks, 8)
        biases = -(dmin[..., None] * m.reshape(*dmin.shape, 8).astype(np.float32))
        # 32 bytes hold sub-block 2j (low nibbles) and 2j + 1 (high nibbles)
        qs = b[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        q = qs & 0xF
    else:
        raise UnsupportedModelError(f"GGUF type {qtype.name} has no exact MLX layout")
    bits = IMPORTED[qtype]
    half = qtype != Q.Q4_K  # the GGUF's own float16 numbers; Q4_K's products need float32
    return {
        "weight": zp_format.pack(q.reshape(rows, cols), bits),
        "scales": np.ascontiguousarray(d.reshape(rows, -1)),
        "biases": np.ascontiguousarray(biases.reshape(rows, -1).astype(
            np.float16 if half else np.float32)),
    }


def save_weights(
    path: Path, gguf, names: dict[str, str], fix_weight: Callable, config: dict, dtype: str,
    progress: bool,
) -> dict[str, Any]:
    """Write the GGUF's tensors to one safetensors file under their Hugging Face names
    (``names``: GGUF name -> HF name; ``fix_weight(gguf name, array, config)`` undoes llama.cpp's
    row permutations, see :mod:`mlxspec.gguf.convert`): the
    :data:`IMPORTED` matrices as MLX quantized weights (``weight``, ``scales``, ``biases``),
    everything else dequantized as :func:`mlxspec.gguf.convert.save_weights` does.

    Returns:
        the ``quantization`` entry of ``config.json`` for mlx-lm (group size 32, 4 bits by
        default, per-layer entries for other widths) plus ``format``, ``source`` and
        ``dequantized`` (the GGUF types that were dequantized).
    """
    float_dtype = getattr(mx, dtype)
    arrays: dict[str, mx.array] = {}
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": 4, "mode": "affine"}
    dequantized: set[str] = set()
    kept = packed_bits()
    with progress_bar("Importing GGUF tensors", len(gguf.tensors), progress) as advance:
        for name, tensor in gguf.tensors.items():
            hf = names[name]
            module = hf.rsplit(".", 1)[0]
            if (IMPORTED.get(tensor.qtype) in kept and len(tensor.shape) == 2
                    and hf.endswith(".weight")):
                for key, value in affine_arrays(tensor.qtype, tensor.raw, tensor.shape).items():
                    if key != "weight" and module in STREAM_ENDS and float_dtype == mx.float32:
                        value = value.astype(np.float32)  # exact; see STREAM_ENDS
                    arrays[f"{module}.{key}"] = mx.array(fix_weight(name, value, config))
                if IMPORTED[tensor.qtype] != 4:
                    quantization[module] = {"group_size": GROUP_SIZE,
                                            "bits": IMPORTED[tensor.qtype], "mode": "affine"}
            else:
                if tensor.qtype not in (Q.F32, Q.F16, Q.BF16):
                    dequantized.add(tensor.qtype.name)
                w = mx.array(fix_weight(name, tensor.dequantize(), config))
                arrays[hf] = w.astype(float_dtype)  # norms too: float32 ones promote activations
            advance()
    mx.save_safetensors(str(path), arrays, metadata={"format": "mlx"})
    return {**quantization, "format": "mlx", "source": "gguf",
            "dequantized": sorted(dequantized)}
