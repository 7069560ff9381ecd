"""Zero-point matmul: the Metal kernels in ``metal/*.metal`` where Metal is available, an MLX
fallback elsewhere.

``zp_matmul(x, weight, scales, zeros, bits=..., group_size=...)`` computes ``x @ W.T`` for a weight
in the format of :mod:`mlxspec.quant.zp_format`. On Metal it dispatches by the number of activation
rows M (:func:`route`):

- M = 1 (decode): ``zp_qmv`` (:func:`metal_qmv`), fused dequantize + mat-vec, simdgroup
  reductions -- unless ``mlxspec doctor --kernels`` measured ``mx.quantized_matmul`` faster for
  this (bits, group size) on this device; ``MLXSPEC_QMV=zp|affine`` overrides;
- M >= 2 (speculative verification, prefill): ``mx.quantized_matmul`` on the same weights in
  their exact affine form (:func:`mlxspec.quant.zp_format.to_mlx_affine`; MLX's tuned qmm/steel
  kernels), or for 2-16 rows the custom ``zp_qmm`` (:func:`metal_qmm`) where it was *measured*
  faster on this Mac. ``MLXSPEC_QMM=zp|affine`` overrides.

``mlxspec doctor --kernels`` times both paths per (bits, group size, rows) and saves the table
(:func:`qmm_choice_path`). Nothing dequantizes a whole layer per call (that would be a multi-GB
transient for large-vocabulary heads). Scales may be float16, bfloat16 or float32 (the kernels
read them as float; float32 scales, written by the quantizer for float32 models such as the
default model, cost 2 more bytes per group than float16 and need no conversion).

Elsewhere (Linux, or ``MLXSPEC_KERNELS=mlx``) every M uses ``mx.quantized_matmul`` on the exact
affine form; pass ``biases`` precomputed once to avoid rebuilding them on every call.

``MLXSPEC_KERNELS=emulate`` (a contributor mode) takes the Metal path on any machine and runs each
kernel launch in the CPU emulator of :mod:`mlxspec.metal.emulator`: the same dispatch, grid and
threadgroup choice and reshapes, the exact kernel text MLX generates; slow, logic only, never a
speed (docs/metal-emulation.md). Every launch goes through :func:`_launch`, which the tests'
harness also patches.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from importlib import resources
from pathlib import Path

import mlx.core as mx

from mlxspec.errors import QuantizationError
from mlxspec.quant import zp_format

QMM_MAX_ROWS = 16
_QMM_CAPACITIES = (4, 8, 16)
QMM_MEASURED_ROWS = (2, 4, 8, 16)  # row counts doctor --kernels times zp_qmm at
MEASURED_ROWS = (1, *QMM_MEASURED_ROWS)  # and zp_qmv at 1
QMM_MIN_SPEEDUP = 1.05  # zp_qmm is used where measured at least this much faster
KERNELS_ENV = "MLXSPEC_KERNELS"  # "auto" (default), "mlx" (the fallback) or "emulate"
EMULATED = "emulated on the CPU: logic only, not a Metal speed"  # said by every emulated report

# name -> (input names, output names); the source is metal/<name>.metal, the header zp_common.h.
KERNELS = {
    "zp_dequantize": (["weight", "scales", "zeros", "K", "N"], ["out"]),
    "zp_qmv": (["x", "weight", "scales", "zeros", "K", "N"], ["y"]),
    "zp_qmm": (["x", "weight", "scales", "zeros", "M", "K", "N"], ["y"]),
}
_FLOAT_TYPES = (mx.float16, mx.bfloat16, mx.float32)


def kernels_setting() -> str:
    """``MLXSPEC_KERNELS``: ``"auto"``, ``"mlx"`` or ``"emulate"``."""
    value = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "mlx", "emulate"):
        raise QuantizationError(f"{KERNELS_ENV}={value!r}: choose auto, mlx or emulate")
    return value


def emulating() -> bool:
    """Whether the Metal path runs in the CPU emulator (``MLXSPEC_KERNELS=emulate``)."""
    return kernels_setting() == "emulate"


def backend() -> str:
    """``"metal"`` if the zero-point kernels run (on the GPU, or emulated), else ``"mlx"`` (the
    affine fallback).

    ``MLXSPEC_KERNELS=mlx`` forces the fallback (to compare against it on a Mac);
    ``MLXSPEC_KERNELS=emulate`` forces the Metal path, its kernels run by the emulator.
    """
    setting = kernels_setting()
    if setting != "auto":
        return "mlx" if setting == "mlx" else "metal"
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


def use_zp_qmv(bits: int, group_size: int) -> bool:
    """Whether one activation row goes to ``zp_qmv`` rather than ``mx.quantized_matmul``:
    ``MLXSPEC_QMV=zp|affine``, else yes unless ``doctor --kernels`` measured it slower on this
    device (it is the decode kernel; a measurement only takes it away)."""
    setting = os.environ.get("MLXSPEC_QMV", "auto")
    if setting in ("zp", "affine"):
        return setting == "zp"
    return _measured_speedups().get((bits, group_size, 1), 1.0) >= 1.0


def use_zp_qmm(bits: int, group_size: int, rows: int) -> bool:
    """Whether ``rows`` (2-16) activation rows go to ``zp_qmm`` rather than
    ``mx.quantized_matmul``: ``MLXSPEC_QMM=zp|affine``, else the measurement at the nearest
    measured row count at or above ``rows``."""
    setting = os.environ.get("MLXSPEC_QMM", "auto")
    if setting in ("zp", "affine"):
        return setting == "zp"
    measured = next(r for r in QMM_MEASURED_ROWS if r >= max(rows, 2))
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


def route(rows: int, bits: int, group_size: int) -> str:
    """The path :func:`metal_matmul` takes for ``rows`` activation rows: ``"zp_qmv"``,
    ``"zp_qmm"`` or ``"affine"`` (``mx.quantized_matmul`` on the exact affine form)."""
    if rows == 1:
        return "zp_qmv" if use_zp_qmv(bits, group_size) else "affine"
    if rows <= QMM_MAX_ROWS and use_zp_qmm(bits, group_size, rows):
        return "zp_qmm"
    return "affine"


def describe() -> str:
    """One line for ``mlxspec doctor``: which zero-point matmul path is active and why."""
    if backend() != "metal":
        why = "MLXSPEC_KERNELS=mlx" if mx.metal.is_available() else "Metal is not available"
        return f"zero-point kernels: MLX fallback (exact affine form via mx.quantized_matmul; {why})"
    slower = sorted(f"{b}-bit g{g}" for (b, g, r), speedup in _measured_speedups().items()
                    if r == 1 and speedup < 1.0)
    decode = "zp_qmv for 1 row" + (f" (mx.quantized_matmul for {', '.join(slower)}: measured "
                                   "faster here)" if slower else "")
    setting = os.environ.get("MLXSPEC_QMM", "auto")
    faster = sorted(f"{b}-bit g{g} M<={r}" for (b, g, r), speedup in _measured_speedups().items()
                    if r > 1 and speedup >= QMM_MIN_SPEEDUP)
    if setting == "zp":
        rows = "zp_qmm for 2-16 rows (MLXSPEC_QMM=zp)"
    elif setting == "affine" or not faster:
        rows = "mx.quantized_matmul on the exact affine form for 2+ rows"
        if setting != "affine":
            rows += " (zp_qmm not measured faster here: mlxspec doctor --kernels times it)"
    else:
        rows = f"zp_qmm where measured faster ({', '.join(faster)}), else mx.quantized_matmul"
    where = f"EMULATED (MLXSPEC_KERNELS=emulate, {EMULATED})" if emulating() else "Metal"
    return f"zero-point kernels: {where} ({decode}; {rows}) from mlxspec.metal"


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
    if emulating():
        return _emulated(name, launch)
    return _kernel(name)(**launch)


def _emulated(name: str, launch: dict) -> list[mx.array]:
    """``MLXSPEC_KERNELS=emulate``: the launch run by the CPU emulator (said once on stderr)."""
    from mlxspec.metal import emulator

    reason = emulator.unavailable()
    if reason:
        raise QuantizationError(f"{KERNELS_ENV}=emulate: {reason}")
    _announce_emulation()
    try:
        return emulator.launch(_kernel(name), **launch)
    except emulator.EmulationError as e:
        raise QuantizationError(f"{name} (emulated): {str(e).strip()}") from e


@functools.cache
def _announce_emulation() -> None:
    print(f"mlxspec: {KERNELS_ENV}=emulate: Metal kernels {EMULATED} (slow)", file=sys.stderr)


def _check(weight: mx.array, scales: mx.array, zeros: mx.array, bits: int, group_size: int):
    """Validate the layer arrays; return (N, K)."""
    n, k = weight.shape[0], weight.shape[1] * 32 // bits
    zp_format.check_spec(bits, group_size, k)
    if weight.dtype != mx.uint32 or zeros.dtype != mx.uint32:
        raise QuantizationError("zero-point weight and zeros must be uint32: re-quantize the model")
    if scales.dtype not in _FLOAT_TYPES:
        raise QuantizationError(f"scales must be float16, bfloat16 or float32, not {scales.dtype}")
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

    The path is :func:`route`'s: ``zp_qmv`` (:func:`metal_qmv`), ``zp_qmm`` (:func:`metal_qmm`)
    or ``mx.quantized_matmul`` on the exact affine form (``biases`` as :func:`fallback_matmul`).
    """
    n, k = _check(weight, scales, zeros, bits, group_size)
    if x.shape[-1] != k:
        raise QuantizationError(f"input has {x.shape[-1]} features, the weight expects {k}")
    if x.dtype not in _FLOAT_TYPES:
        raise QuantizationError(f"activations must be float16, bfloat16 or float32, not {x.dtype}")
    rows = x.reshape(-1, k)
    path = route(rows.shape[0], bits, group_size)
    if path == "zp_qmv":
        y = metal_qmv(rows, weight, scales, zeros, bits=bits, group_size=group_size)
    elif path == "zp_qmm":
        y = metal_qmm(rows, weight, scales, zeros, bits=bits, group_size=group_size)
    else:
        y = fallback_matmul(rows, weight, scales, zeros, bits=bits, group_size=group_size,
                            biases=biases)
    return y.reshape(*x.shape[:-1], n)


def metal_qmv(
    rows: mx.array, weight: mx.array, scales: mx.array, zeros: mx.array, *, bits: int,
    group_size: int,
) -> mx.array:
    """The ``zp_qmv`` kernel: one row (1, K) -> (1, N) of its dtype. Grid (32, ceil(N / 4)),
    threadgroup (32, 2): each simdgroup owns 4 output rows."""
    n, k = _check(weight, scales, zeros, bits, group_size)
    return _launch(
        "zp_qmv",
        inputs=[rows.reshape(k), weight, scales, zeros, k, n],
        template=_template(rows.dtype, bits, group_size),
        grid=(32, (n + 3) // 4, 1),
        threadgroup=(32, 2, 1),
        output_shapes=[(1, n)],
        output_dtypes=[rows.dtype],
    )[0]


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
