"""Read a GGUF file (llama.cpp's format): metadata, and tensors as memory-mapped views.

Every field is checked as it is read (array nesting, alignment, tensor ranks and sizes), so a
damaged or hostile file is a ``CorruptModelError`` naming the problem, never a crash.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from mlxspec.errors import CorruptModelError, UnsupportedModelError
from mlxspec.model_checks import is_int

# -- reading a GGUF file --------------------------------------------------------------------------
# gguf.GGUFReader builds a numpy memmap per array element, which takes ~20 s on Gemma-3's 262k-token
# vocabulary; the header is a simple little-endian format, so it is parsed here directly.

_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: ``shape`` in numpy order (rows first), ``raw`` its bytes as
    (rows, bytes per row) uint8, still quantized."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    raw: np.ndarray

    def dequantize(self) -> np.ndarray:
        """The tensor as float32 numpy, shape ``self.shape``."""
        try:
            values = dequantize(self.raw, self.qtype)
        except NotImplementedError:
            raise UnsupportedModelError(
                f"GGUF tensor {self.name} has type {self.qtype.name}, which cannot be dequantized"
            ) from None
        return values.astype(np.float32, copy=False).reshape(self.shape)


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: its metadata (key -> value, arrays as lists) and its tensors by name."""

    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


MAX_ARRAY_DEPTH = 4  # metadata arrays of arrays nested deeper than this are refused
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40  # no real tensor comes near; beyond it the sizes overflow int64


class _Cursor:
    """Reads little-endian values from a buffer, advancing a position."""

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        if self.pos + size > len(self.buf):
            raise struct.error("string runs past the end of the file")
        text = self.buf[self.pos : self.pos + size].decode("utf-8")
        self.pos += size
        return text

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise ValueError(f"metadata arrays nested more than {MAX_ARRAY_DEPTH} deep")
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _SCALARS:  # numbers in one read
                dtype = np.dtype(_SCALARS[item_type])
                if count * dtype.itemsize > len(self.buf) - self.pos:
                    raise struct.error("array runs past the end of the file")
                values = np.frombuffer(self.buf, dtype, count, self.pos)
                self.pos += count * dtype.itemsize
                return values.tolist()
            if count * 8 > len(self.buf) - self.pos:  # every string or array takes >= 8 bytes
                raise struct.error("array runs past the end of the file")
            return [self.value(item_type, depth + 1) for _ in range(count)]
        return self.scalar(_SCALARS[GGUFValueType(vtype)])


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF (v2/v3) file's metadata and tensor index; tensor bytes stay memory-mapped.

    Raises CorruptModelError when the file is not a GGUF file or is truncated.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: empty file
        raise CorruptModelError(f"cannot read GGUF file {path}: {e}") from None
    if buf[:4] != b"GGUF":
        raise CorruptModelError(f"{path} is not a GGUF file (bad magic bytes)")
    cursor = _Cursor(buf)
    cursor.pos = 4
    try:
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = cursor.scalar("<Q"), cursor.scalar("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("<I"))
        index = []
        for _ in range(n_tensors):
            name = cursor.string()
            n_dims = cursor.scalar("<I")
            if n_dims > MAX_DIMS:
                raise ValueError(f"tensor {name} has {n_dims} dimensions")
            dims = [cursor.scalar("<Q") for _ in range(n_dims)]
            index.append((name, dims, cursor.scalar("<I"), cursor.scalar("<Q")))
        if len({entry[0] for entry in index}) != len(index):
            raise ValueError("two tensors have the same name")
    except (struct.error, UnicodeDecodeError, ValueError, KeyError, OverflowError) as e:
        raise CorruptModelError(f"{path} is truncated or corrupt (header: {e})") from None

    alignment = metadata.get("general.alignment", 32)
    if not is_int(alignment) or alignment <= 0 or alignment % 8:
        raise CorruptModelError(
            f"{path}: general.alignment is {alignment!r}, not a positive multiple of 8"
        )
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in index:
        tensors[name] = _tensor(path, buf, name, dims, type_id, data_start, offset, alignment)
    return GGUFFile(metadata, tensors)


def _tensor(path, buf, name, dims, type_id, data_start, offset, alignment) -> GGUFTensor:
    """One entry of the tensor index, its shape and byte range checked against the file."""
    try:
        qtype = GGMLQuantizationType(type_id)
        block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise UnsupportedModelError(f"GGUF tensor {name} has unknown type id {type_id}") from None
    if not 1 <= len(dims) <= MAX_DIMS or any(d <= 0 for d in dims):
        raise CorruptModelError(f"{path}: tensor {name} has invalid dimensions {dims}")
    if math.prod(dims) > MAX_ELEMENTS:
        raise CorruptModelError(f"{path}: tensor {name} dimensions {dims} are impossibly large")
    if dims[0] % block_size:
        raise CorruptModelError(
            f"{path}: tensor {name} has rows of {dims[0]} values, not a whole number of "
            f"{qtype.name} blocks of {block_size}"
        )
    if offset % alignment:
        raise CorruptModelError(f"{path}: tensor {name} is not aligned to {alignment} bytes")
    shape = tuple(reversed(dims))  # ggml lists the fastest-varying dimension first
    row_bytes = dims[0] // block_size * block_bytes
    rows = math.prod(dims[1:])
    start = data_start + offset
    if start + rows * row_bytes > len(buf):
        raise CorruptModelError(f"{path} is truncated: tensor {name} runs past the end")
    raw = np.frombuffer(buf, np.uint8, rows * row_bytes, start).reshape(rows, row_bytes)
    return GGUFTensor(name, shape, qtype, raw)
