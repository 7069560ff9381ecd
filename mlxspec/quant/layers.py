"""Zero-point quantized layers, drop-in replacements for ``nn.Linear`` and ``nn.Embedding`` in any
mlx-lm model (saving and loading: :mod:`mlxspec.quant.storage`).

Each layer holds the three arrays of :mod:`mlxspec.quant.zp_format` (``weight``, ``scales``,
``zeros``), plus ``bias`` when the layer has one and ``perm`` for GPTQ act-order layers, whose
groups follow a permutation of the input features (``y = x[..., perm] @ W.T``).

How ``x @ W.T`` runs (:func:`matmul_path`):

- Metal: the zero-point kernels (:func:`mlxspec.quant.kernels.zp_matmul`).
- CPU with mlxspec's packed-weight kernel (``mlxspec.cpu.quantized_matmul``, Linux x86-64 with
  AVX2; faster than a float32 copy through BLAS at 1-24 rows, ``bench/decode.py``): ``"packed"``,
  no float32 copy at all.
- CPU without it (``MLXSPEC_CPU_QMM=0``, no compiler): MLX's CPU ``quantized_matmul`` is a plain loop that redoes the
  whole mat-vec for every row of ``x``, while a float32 matmul goes through the optimized BLAS that
  ``import mlxspec`` loads. Measured on a 2-core x86 machine for every layer shape of SmolLM2-135M
  and Gemma-3-270M at M = 1, 2, 4, 8 rows (``bench/quantized.py``, "kernels"), BLAS on a float32
  copy dequantized once was the fastest in all 87 cases: 2-2.5x faster at M = 1 (1.5x for the
  vocabulary-sized heads) and 15-60x at M = 8, at 4 and 8 bits. So on the
  CPU each layer dequantizes itself once, on first use, into a float32 copy (exact: see
  :func:`mlxspec.quant.zp_format.dequantize`) -- *quantization then saves disk and download size but
  not memory or time on a CPU* -- as long as the copies fit in a budget (``MLXSPEC_ZP_DENSE_GB``,
  default a quarter of physical memory); layers past the budget stay packed and use
  ``mx.quantized_matmul`` on the exact affine form. ``MLXSPEC_ZP_CPU=quantized`` keeps every layer
  packed (least memory), ``MLXSPEC_ZP_CPU=dense`` ignores the budget.
"""

from __future__ import annotations

import os
import weakref

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlxspec import cpu
from mlxspec.errors import QuantizationError
from mlxspec.quant import kernels, zp_format

CPU_PATH_ENV = "MLXSPEC_ZP_CPU"  # "auto" (default), "dense" or "quantized"
DENSE_BUDGET_ENV = "MLXSPEC_ZP_DENSE_GB"  # float32 copies allowed on the CPU path, in GB

_dense_bytes = 0  # float32 copies currently held by CPU-path layers, in bytes


# -- the CPU matmul policy -----------------------------------------------------------------------


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def dense_budget() -> int:
    """Bytes of float32 copies the CPU path may hold (``MLXSPEC_ZP_DENSE_GB``)."""
    value = os.environ.get(DENSE_BUDGET_ENV)
    if value:
        try:
            return int(float(value) * 1e9)
        except ValueError as e:
            raise QuantizationError(f"{DENSE_BUDGET_ENV}={value!r} is not a number of GB") from e
    return _physical_memory() // 4


def cpu_path_setting() -> str:
    """``MLXSPEC_ZP_CPU``: ``"auto"``, ``"dense"`` or ``"quantized"``."""
    value = os.environ.get(CPU_PATH_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "dense", "quantized"):
        raise QuantizationError(f"{CPU_PATH_ENV}={value!r}: choose auto, dense or quantized")
    return value


def matmul_path(out_features: int, in_features: int) -> str:
    """How a zero-point layer of this shape multiplies on the active backend right now:
    ``"metal"`` (zero-point kernels), ``"packed"`` (mlxspec's CPU kernel on the packed weight),
    ``"dense"`` (float32 copy + BLAS) or ``"quantized"`` (``mx.quantized_matmul`` on the affine
    form). See the module docstring for the measurements.
    """
    # The device decides (a GPU never holds float32 copies); MLXSPEC_KERNELS=emulate takes the
    # Metal path on a CPU too.
    if mx.metal.is_available() or kernels.emulating():
        return "metal" if kernels.backend() == "metal" else "quantized"
    setting = cpu_path_setting()
    if setting != "auto":
        return setting
    if cpu.quantized_products():
        return "packed"
    fits = _dense_bytes + 4 * out_features * in_features <= dense_budget()
    return "dense" if fits else "quantized"


def describe() -> str:
    """One line for ``mlxspec doctor``: how zero-point layers multiply here."""
    if mx.metal.is_available() or kernels.emulating():
        if kernels.emulating():
            return f"zero-point layers: Metal kernels, {kernels.EMULATED} (MLXSPEC_KERNELS=emulate)"
        return ("zero-point layers: Metal kernels" if kernels.backend() == "metal" else
                "zero-point layers: mx.quantized_matmul on the GPU (MLXSPEC_KERNELS=mlx)")
    setting = cpu_path_setting()
    used = f"{_dense_bytes / 1e9:.2f} GB of float32 copies held"
    if setting == "quantized":
        return "zero-point layers on CPU: packed, mx.quantized_matmul (MLXSPEC_ZP_CPU=quantized)"
    if setting == "dense":
        return f"zero-point layers on CPU: float32 copy + BLAS for every layer ({used})"
    if cpu.quantized_products():
        return "zero-point layers on CPU: packed, mlxspec's CPU kernel (no float32 copies)"
    return (
        "zero-point layers on CPU: float32 copy + BLAS (faster than quantized_matmul at every "
        f"measured shape) within {dense_budget() / 1e9:.1f} GB, packed beyond ({used})"
    )


def _release(nbytes: int) -> None:
    global _dense_bytes
    _dense_bytes -= nbytes


class _Derived:
    """Arrays derived from a layer's packed weight (not a KV cache), rebuilt when the weight
    arrays change: the affine biases ``-s*z`` (exact dtype, see :func:`zp_format.to_mlx_affine`),
    and on the CPU dense path a float32 copy of the weight, made on the first matmul."""

    def __init__(self, source):
        self.source = source  # (weight, scales, zeros) the derived arrays were built from
        self.biases = None
        self.path = None
        self.dense = None  # float32 (out, in)


# -- the layers ----------------------------------------------------------------------------------


class _ZeroPoint(nn.Module):
    """The packed weight shared by :class:`ZeroPointLinear` and :class:`ZeroPointEmbedding`."""

    def __init__(self, out_features: int, in_features: int, bits: int, group_size: int):
        super().__init__()
        zp_format.check_spec(bits, group_size, in_features)
        self.bits, self.group_size = bits, group_size
        self.in_features, self.out_features = in_features, out_features
        n_groups = in_features // group_size
        self.weight = mx.zeros((out_features, in_features * bits // 32), dtype=mx.uint32)
        self.scales = mx.ones((out_features, n_groups), dtype=mx.float16)
        self.zeros = mx.zeros((out_features, zp_format.packed_cols(n_groups, bits)), dtype=mx.uint32)
        self._cache: _Derived | None = None

    def set_quantized(self, q, scales, zeros, scale_dtype=mx.float16) -> None:
        """Store integers ``q`` ``(out, in)``, scales (as ``scale_dtype``) and integer
        zero-points ``(out, in / g)``."""
        self.weight = mx.array(zp_format.pack(q, self.bits))
        self.scales = mx.array(scales).astype(scale_dtype)
        self.zeros = mx.array(zp_format.pack(zeros, self.bits))

    def dequantize(self, dtype=mx.float32) -> mx.array:
        """The dense weight ``(out, in)`` in the stored column order (``perm`` not undone)."""
        return zp_format.dequantize(
            self.weight, self.scales, self.zeros, self.bits, self.group_size, dtype=dtype
        )

    def _derived(self) -> _Derived:
        """This layer's derived arrays, rebuilt if its arrays were replaced (e.g. by
        load_weights)."""
        d = self._cache
        source = (self.weight, self.scales, self.zeros)
        if d is None or any(a is not b for a, b in zip(d.source, source, strict=True)):
            self._cache = d = _Derived(source)
            d.biases = zp_format.to_mlx_affine(*source, self.bits, self.group_size)[2]
        return d

    def drop_derived(self) -> None:
        """Free the derived arrays (the CPU path's float32 copy); rebuilt on the next call."""
        self._cache = None

    def _matmul(self, x: mx.array) -> mx.array:
        """``x @ W.T``: x ``(..., in)`` float -> ``(..., out)`` of x's dtype."""
        d = self._derived()
        if d.path is None:
            d.path = matmul_path(self.out_features, self.in_features)
            if d.path == "dense":
                global _dense_bytes
                d.dense = self.dequantize(mx.float32)
                nbytes = 4 * self.out_features * self.in_features
                _dense_bytes += nbytes
                weakref.finalize(d, _release, nbytes)
        if d.path == "dense":
            return (x.astype(mx.float32) @ d.dense.T).astype(x.dtype)
        if d.path == "packed":
            y = cpu.quantized_matmul(x, self.weight, self.scales, d.biases,
                                     group_size=self.group_size, bits=self.bits)
            if y is not None:  # None: a layout the kernel does not take (5 bits), MLX's own below
                return y
        return kernels.zp_matmul(
            x, self.weight, self.scales, self.zeros, bits=self.bits,
            group_size=self.group_size, biases=d.biases,
        )

    def _extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}"
        )


class ZeroPointLinear(_ZeroPoint):
    """``y = x @ W.T (+ bias)`` with ``W`` in the zero-point format; drop-in for ``nn.Linear``.

    Parameters: ``weight`` uint32 ``(out, in * bits / 32)``, ``scales`` float16 ``(out, in / g)``,
    ``zeros`` uint32 ``(out, ceil(in / g * bits / 32))``, optional ``bias`` ``(out,)`` and optional
    ``perm`` uint32 ``(in,)`` (act-order: column ``j`` of W belongs to input feature ``perm[j]``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        bits: int = 4,
        group_size: int = 64,
        permuted: bool = False,
    ):
        super().__init__(out_features, in_features, bits, group_size)
        if bias:
            self.bias = mx.zeros((out_features,))
        if permuted:
            self.perm = mx.arange(in_features, dtype=mx.uint32)
        self.freeze()

    @classmethod
    def from_quantized(
        cls, q, scales, zeros, *, bits: int, group_size: int, bias=None, perm=None,
        scale_dtype=mx.float16,
    ) -> ZeroPointLinear:
        """A layer from integer ``q`` ``(out, in)``, ``scales`` and integer ``zeros``
        ``(out, in / g)`` (numpy or mx), an optional ``bias`` and act-order ``perm``."""
        out_features, in_features = q.shape
        layer = cls(
            in_features, out_features, bias is not None, bits=bits, group_size=group_size,
            permuted=perm is not None,
        )
        layer.set_quantized(q, scales, zeros, scale_dtype)
        if bias is not None:
            layer.bias = mx.array(bias)
        if perm is not None:
            layer.perm = mx.array(perm).astype(mx.uint32)
        return layer

    def __call__(self, x: mx.array) -> mx.array:
        """x: ``(..., in_features)`` float -> ``(..., out_features)`` of the same dtype."""
        if "perm" in self:
            x = mx.take(x, self["perm"], axis=-1)
        y = self._matmul(x)
        if "bias" in self:
            y = y + self["bias"]
        return y


class ZeroPointEmbedding(_ZeroPoint):
    """A zero-point embedding table ``(num_embeddings, dims)``; drop-in for ``nn.Embedding``,
    including ``as_linear`` for models whose output head is tied to it.

    ``dtype`` is the dtype of the looked-up rows (the model's activation dtype; the scales are
    always float16).
    """

    def __init__(
        self, num_embeddings: int, dims: int, *, bits: int = 4, group_size: int = 64,
        dtype=mx.float32,
    ):
        super().__init__(num_embeddings, dims, bits, group_size)
        self.num_embeddings, self.dims, self.dtype = num_embeddings, dims, dtype
        self.freeze()

    @classmethod
    def from_quantized(
        cls, q, scales, zeros, *, bits: int, group_size: int, dtype=mx.float32,
        scale_dtype=mx.float16,
    ) -> ZeroPointEmbedding:
        num_embeddings, dims = q.shape
        layer = cls(num_embeddings, dims, bits=bits, group_size=group_size, dtype=dtype)
        layer.set_quantized(q, scales, zeros, scale_dtype)
        return layer

    def __call__(self, ids: mx.array) -> mx.array:
        """ids: integer ``(...)`` -> ``(..., dims)`` of ``self.dtype``.

        Rows are dequantized as looked up (never a dense copy of the table for lookups): in the
        scales' dtype when the affine form is exact in it, else in float32."""
        d = self._derived()
        scales = self.scales[ids]
        if d.biases.dtype != scales.dtype:
            scales = scales.astype(mx.float32)  # float32 biases: s*q - s*z is exact only there
        rows = mx.dequantize(self.weight[ids], scales, d.biases[ids], self.group_size, self.bits)
        return rows.astype(self.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        """The tied output head: x ``(..., dims)`` -> logits ``(..., num_embeddings)``."""
        return self._matmul(x)

    def _extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dims}, bits={self.bits}, group_size={self.group_size}"


ZERO_POINT_LAYERS = (ZeroPointLinear, ZeroPointEmbedding)
MLX_QUANTIZED_LAYERS = (nn.QuantizedLinear, nn.QuantizedEmbedding)


# -- model conversion helpers ------------------------------------------------------------------


def replace_modules(model: nn.Module, modules: dict[str, nn.Module]) -> None:
    """Swap the submodules at the given dotted paths (e.g. ``model.layers.0.mlp.up_proj``)."""
    if modules:
        model.update_modules(tree_unflatten(list(modules.items())))


def zero_point_like(
    module: nn.Module, q, scales, zeros, *, bits: int, group_size: int, perm=None, dtype=None
) -> nn.Module:
    """The zero-point replacement of an ``nn.Linear`` (bias kept) or ``nn.Embedding``, from
    integers ``q`` ``(out, in)``, ``scales`` and ``zeros`` ``(out, in / g)``.

    ``dtype``: the model's dtype (scales, bias, looked-up rows); default the module's."""
    dtype = dtype or module.weight.dtype
    if isinstance(module, nn.Embedding):
        return ZeroPointEmbedding.from_quantized(
            q, scales, zeros, bits=bits, group_size=group_size, dtype=dtype, scale_dtype=dtype
        )
    bias = module.get("bias")
    return ZeroPointLinear.from_quantized(
        q, scales, zeros, bits=bits, group_size=group_size, perm=perm, scale_dtype=dtype,
        bias=None if bias is None else bias.astype(dtype),
    )


def zero_point_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Path -> layer of every zero-point layer in ``model``."""
    return {p: m for p, m in model.named_modules() if isinstance(m, ZERO_POINT_LAYERS)}


def is_quantized(model: nn.Module) -> bool:
    """True if any layer of ``model`` is already quantized (zero-point or MLX affine)."""
    return any(
        isinstance(m, ZERO_POINT_LAYERS + MLX_QUANTIZED_LAYERS) or "scales" in m
        for _, m in model.named_modules()
    )


def model_summary(model: nn.Module) -> dict:
    """Counts for reports: zero-point layers by bits and the CPU paths they took."""
    layers = zero_point_modules(model).values()
    by_bits: dict[int, int] = {}
    for layer in layers:
        by_bits[layer.bits] = by_bits.get(layer.bits, 0) + 1
    return {
        "zero_point_layers": len(layers),
        "layers_by_bits": by_bits,
        "dense_float32_gb": _dense_bytes / 1e9,
    }


def zero_point_from_affine(layer: nn.Module) -> nn.Module | None:
    """The zero-point twin of an MLX ``QuantizedLinear``/``QuantizedEmbedding`` whose biases are
    ``-scale * z`` for integer ``z`` (:func:`zp_format.zeros_from_affine`), sharing its packed
    weight and scales; None for any other layer (float minimum biases, other modes or bits)."""
    if getattr(layer, "mode", "affine") != "affine" or "biases" not in layer:
        return None
    bits, group_size = layer.bits, layer.group_size
    if bits not in zp_format.SUPPORTED_BITS or group_size not in zp_format.SUPPORTED_GROUP_SIZES:
        return None
    z = zp_format.zeros_from_affine(layer.scales, layer.biases, bits)
    if z is None:
        return None
    out_features, in_features = layer.weight.shape[0], layer.weight.shape[1] * 32 // bits
    if isinstance(layer, nn.QuantizedEmbedding):
        # Rows in the scales' dtype, as MLX's QuantizedEmbedding returns them: the model's
        # activation dtype (float16 for a GGUF import on Metal, gguf.dtype.conversion_dtype;
        # a float32 import keeps float32 scales on its table, gguf.tensors.STREAM_ENDS).
        new = ZeroPointEmbedding(out_features, in_features, bits=bits, group_size=group_size,
                                 dtype=layer.scales.dtype)
    else:
        new = ZeroPointLinear(in_features, out_features, "bias" in layer, bits=bits,
                              group_size=group_size)
        if "bias" in layer:
            new.bias = layer.bias
    new.weight, new.scales, new.zeros = layer.weight, layer.scales, mx.array(zp_format.pack(z, bits))
    return new
