"""Zero-point matmul: the Metal kernels in ``metal/*.metal`` where Metal is available, an MLX
fallback elsewhere.

``zp_matmul(x, weight, scales, zeros, bits=..., group_size=...)`` computes ``x @ W.T`` for a weight
in the format of :mod:`mlxspec.quant.zp_format`. On Metal it dispatches by the number of activation
rows M:

- M = 1: ``zp_qmv`` (decode): fused dequantize + mat-vec, simdgroup reductions;
- M >= 2 (speculative verification, prefill): ``mx.quantized_matmul`` on the same weights in
  their exact affine form (:func:`mlxspec.quant.zp_format.to_mlx_affine`; MLX's tuned qmm/steel
  kernels), or for 2-16 rows the custom ``zp_qmm`` (:func:`metal_qmm`) where it was *measured*
  faster on this Mac: ``mlxspec doctor --kernels`` times both per (bits, group size, rows) and
  saves the table (:func:`qmm_choice_path`); without a measurement the tuned MLX kernels are
  used. ``MLXSPEC_QMM=zp|affine`` overrides. Nothing dequantizes a whole layer per call (that
  was a multi-GB transient for large-vocabulary heads).

Elsewhere (Linux, or ``MLXSPEC_KERNELS=mlx``) every M uses ``mx.quantized_matmul`` on the exact
affine form; pass ``biases`` precomputed once to avoid rebuilding them on every call.

Every kernel launch goes through :func:`_launch`, so the test suite's emulator can run the exact
Metal source MLX generates on a CPU (``tests/metal_emu``).
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from pathlib import Path

import mlx.core as mx

from mlxspec.errors import QuantizationError
from mlxspec.quant import zp_format

QMM_MAX_ROWS = 16
_QMM_CAPACITIES = (4, 8, 16)
QMM_MEASURED_ROWS = (2, 4, 8, 16)  # row counts doctor --kernels times zp_qmm at
QMM_MIN_SPEEDUP = 1.05  # zp_qmm is used where measured at least this much faster

# name -> (input names, output names); the source is metal/<name>.metal, the header zp_common.h.
KERNELS = {
    "zp_dequantize": (["weight", "scales", "zeros", "K", "N"], ["out"]),
    "zp_qmv": (["x", "weight", "scales", "zeros", "K", "N"], ["y"]),
    "zp_qmm": (["x", "weight", "scales", "zeros", "M", "K", "N"], ["y"]),
}
_FLOAT_TYPES = (mx.float16, mx.bfloat16, mx.float32)


def backend() -> str:
    """``"metal"`` if the zero-point kernels run, else ``"mlx"`` (the affine fallback).

    ``MLXSPEC_KERNELS=mlx`` forces the fallback (to compare against it on a Mac).
    """
    if os.environ.get("MLXSPEC_KERNELS", "auto") == "mlx":
        return "mlx"
    return "metal" if mx.metal.is_available() else "mlx"


def qmm_choice_path() -> Path:
    """Where ``mlxspec doctor --kernels`` saves its zp_qmm-vs-affine timings (JSON)."""
    from mlxspec import paths

    return paths.home() / "kernels" / "qmm_choice.json"


def device_name() -> str:
    """The GPU's name (measurements are kept per device), or "" without Metal."""
    try:
        return str(mx.device_info().get("device_name", ""))
    except Exception:  # noqa: BLE001  (no Metal back-end: nothing was measured here)
        return ""


@functools.cache
def _measured_speedups() -> dict[tuple[int, int, int], float]:
    """(bits, group size, rows) -> affine time / zp_qmm time, as measured on this device."""
    try:
        saved = json.loads(qmm_choice_path().read_text())
        if saved.get("device") != device_name():
            return {}
        return {(r["bits"], r["group_size"], r["rows"]): float(r["speedup"])
                for r in saved["rows"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # none, or unreadable: the tuned MLX kernels


def use_zp_qmm(bits: int, group_size: int, rows: int) -> bool:
    """Whether ``rows`` (2-16) activation rows go to ``zp_qmm`` rather than
    ``mx.quantized_matmul``: ``MLXSPEC_QMM=zp|affine``, else the measurement at the nearest
    measured row count at or above ``rows``."""
    setting = os.environ.get("MLXSPEC_QMM", "auto")
    if setting in ("zp", "affine"):
        return setting == "zp"
    measured = next(r for r in QMM_MEASURED_ROWS if r >= rows)
    return _measured_speedups().get((bits, group_size, measured), 0.0) >= QMM_MIN_SPEEDUP


def save_qmm_choice(rows: list[dict]) -> Path:
    """Save ``[{"bits", "group_size", "rows", "speedup"}, ...]`` for this device (atomically)."""
    path = qmm_choice_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"device": device_name(), "mlx": mx.__version__, "rows": rows},
                              indent=1))
    tmp.replace(path)
    _measured_speedups.cache_clear()
    return path


def describe() -> str:
    """One line for ``mlxspec doctor``: which zero-point matmul path is active and why."""
    if backend() != "metal":
        why = "MLXSPEC_KERNELS=mlx" if mx.metal.is_available() else "Metal is not available"
        return f"zero-point kernels: MLX fallback (exact affine form via mx.quantized_matmul; {why})"
    setting = os.environ.get("MLXSPEC_QMM", "auto")
    faster = sorted(f"{b}-bit g{g} M<={r}" for (b, g, r), speedup in _measured_speedups().items()
                    if speedup >= QMM_MIN_SPEEDUP)
    if setting == "zp":
        rows = "zp_qmm for 2-16 rows (MLXSPEC_QMM=zp)"
    elif setting == "affine" or not faster:
        rows = "mx.quantized_matmul on the exact affine form for 2+ rows"
        if setting != "affine":
            rows += " (zp_qmm not measured faster here: mlxspec doctor --kernels times it)"
    else:
        rows = f"zp_qmm where measured faster ({', '.join(faster)}), else mx.quantized_matmul"
    return f"zero-point kernels: Metal (zp_qmv for 1 row; {rows}) from mlxspec.metal"


def _source(name: str) -> str:
    """Text of ``metal/<name>`` (installed as package data ``mlxspec.metal``)."""
    return resources.files("mlxspec.metal").joinpath(name).read_text()


def make_kernel(name: str, source: str, header: str):
    """The ``mx.fast.metal_kernel`` for kernel ``name`` built from the given text."""
    input_names, output_names = KERNELS[name]
    return mx.fast.metal_kernel(
        name=name,
        input_names=input_names,
        output_names=output_names,
        source=source,
        header=header,
    )


@functools.cache
def _kernel(name: str):
    return make_kernel(name, _source(f"{name}.metal"), _source("zp_common.h"))


def _launch(name: str, **launch) -> list[mx.array]:
    """Run kernel ``name``; ``launch`` holds the keyword arguments of a metal_kernel call."""
    return _kernel(name)(**launch)


def _check(weight: mx.array, scales: mx.array, zeros: mx.array, bits: int, group_size: int):
    """Validate the layer arrays; return (N, K)."""
    n, k = weight.shape[0], weight.shape[1] * 32 // bits
    zp_format.check_spec(bits, group_size, k)
    if weight.dtype != mx.uint32 or zeros.dtype != mx.uint32:
        raise QuantizationError("zero-point weight and zeros must be uint32: re-quantize the model")
    if scales.dtype not in (mx.float16, mx.bfloat16):
        raise QuantizationError(f"scales must be float16 or bfloat16, not {scales.dtype}")
    if scales.shape != (n, k // group_size) or zeros.shape != (
        n,
        zp_format.packed_cols(k // group_size, bits),
    ):
        raise QuantizationError(
            f"scales {scales.shape} / zeros {zeros.shape} do not match weight {weight.shape}"
        )
    if n * k >= 2**32:
        raise QuantizationError(f"a {n}x{k} weight is too large for the kernels' 32-bit indexing")
    return n, k


def _template(dtype, bits: int, group_size: int, **extra) -> list:
    return [("T", dtype), ("BITS", bits), ("GROUP_SIZE", group_size), *extra.items()]


def metal_dequantize(
    weight: mx.array, scales: mx.array, zeros: mx.array, *, bits: int, group_size: int, dtype
) -> mx.array:
    """Dense weight ``(N, K)`` of ``dtype`` on the GPU; equals :func:`zp_format.dequantize`."""
    n, k = _check(weight, scales, zeros, bits, group_size)
    return _launch(
        "zp_dequantize",
        inputs=[weight, scales, zeros, k, n],
        template=_template(dtype, bits, group_size),
        grid=(k // 8, n, 1),
        threadgroup=(min(k // 8, 256), 1, 1),
        output_shapes=[(n, k)],
        output_dtypes=[dtype],
    )[0]


def metal_matmul(
    x: mx.array, weight: mx.array, scales: mx.array, zeros: mx.array, *, bits: int,
    group_size: int, biases: mx.array | None = None,
) -> mx.array:
    """``x @ W.T`` on Metal. x: (..., K) float16/bfloat16/float32 -> (..., N) of x's dtype.

    One row: the ``zp_qmv`` kernel. More rows: ``mx.quantized_matmul`` on the exact affine form
    (``biases`` as :func:`fallback_matmul`), or :func:`metal_qmm` where :func:`use_zp_qmm`.
    """
    n, k = _check(weight, scales, zeros, bits, group_size)
    if x.shape[-1] != k:
        raise QuantizationError(f"input has {x.shape[-1]} features, the weight expects {k}")
    if x.dtype not in _FLOAT_TYPES:
        raise QuantizationError(f"activations must be float16, bfloat16 or float32, not {x.dtype}")
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m == 1:
        y = _launch(
            "zp_qmv",
            inputs=[rows.reshape(k), weight, scales, zeros, k, n],
            template=_template(x.dtype, bits, group_size),
            grid=(32, (n + 3) // 4, 1),
            threadgroup=(32, 2, 1),
            output_shapes=[(1, n)],
            output_dtypes=[x.dtype],
        )[0]
    elif m <= QMM_MAX_ROWS and use_zp_qmm(bits, group_size, m):
        y = metal_qmm(rows, weight, scales, zeros, bits=bits, group_size=group_size)
    else:
        y = fallback_matmul(rows, weight, scales, zeros, bits=bits, group_size=group_size,
                            biases=biases)
    return y.reshape(*x.shape[:-1], n)


def metal_qmm(
    rows: mx.array, weight: mx.array, scales: mx.array, zeros: mx.array, *, bits: int,
    group_size: int,
) -> mx.array:
    """The ``zp_qmm`` kernel: rows (M, K) with 2 <= M <= 16 -> (M, N) of rows' dtype; each weight
    read and dequantized once for all rows (M FMAs per weight, no staging, no barrier).
    Grid (32, ceil(N / 4)), threadgroup (32, 2), as ``zp_qmv``."""
    n, k = _check(weight, scales, zeros, bits, group_size)
    m = rows.shape[0]
    capacity = next(c for c in _QMM_CAPACITIES if c >= m)
    return _launch(
        "zp_qmm",
        inputs=[rows, weight, scales, zeros, m, k, n],
        template=_template(rows.dtype, bits, group_size, BM=capacity),
        grid=(32, (n + 3) // 4, 1),
        threadgroup=(32, 2, 1),
        output_shapes=[(m, n)],
        output_dtypes=[rows.dtype],
    )[0]


def fallback_matmul(
    x: mx.array,
    weight: mx.array,
    scales: mx.array,
    zeros: mx.array,
    *,
    bits: int,
    group_size: int,
    biases: mx.array | None = None,
) -> mx.array:
    """``x @ W.T`` through ``mx.quantized_matmul`` on the exact affine form (any device).

    ``biases``: float32 ``-s*z`` from :func:`zp_format.to_mlx_affine`, computed here when omitted.
    """
    if biases is None:
        _, _, biases = zp_format.to_mlx_affine(weight, scales, zeros, bits, group_size)
    y = mx.quantized_matmul(
        x, weight, scales, biases, transpose=True, group_size=group_size, bits=bits
    )
    return y.astype(x.dtype)


def zp_matmul(
    x: mx.array,
    weight: mx.array,
    scales: mx.array,
    zeros: mx.array,
    *,
    bits: int,
    group_size: int,
    biases: mx.array | None = None,
) -> mx.array:
    """``x @ W.T`` for a zero-point weight, on the active :func:`backend`.

    Args:
        x: ``(..., K)`` float16, bfloat16 or float32.
        weight, scales, zeros: the layer in :mod:`mlxspec.quant.zp_format` layout, W is ``(N, K)``.
        biases: precomputed float32 affine biases for the fallback (ignored by the kernels).

    Returns:
        ``(..., N)`` in ``x.dtype``, accumulated in float32.
    """
    if backend() == "metal":
        return metal_matmul(x, weight, scales, zeros, bits=bits, group_size=group_size,
                            biases=biases)
    return fallback_matmul(
        x, weight, scales, zeros, bits=bits, group_size=group_size, biases=biases
    )
