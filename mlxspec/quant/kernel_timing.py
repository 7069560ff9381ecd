"""Timing of the zero-point kernels against ``mx.quantized_matmul`` on a Mac (``mlxspec doctor
--kernels``, ``bench/kernels.py``), every timed row also compared with the fallback; the table of
measured speedups that :func:`mlxspec.quant.kernels.route` reads; the GPU's copy bandwidth.

Under ``MLXSPEC_KERNELS=emulate`` the same code runs with emulated kernels: the times are then
CPU emulation (the rows say so), and nothing is saved."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from mlxspec.quant import zp_format
from mlxspec.quant.kernels import (
    EMULATED,
    MEASURED_ROWS,
    QMM_MAX_ROWS,
    emulating,
    fallback_matmul,
    metal_qmm,
    metal_qmv,
    save_qmm_choice,
)

TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}  # max error / max |y|


def relative_error(got: mx.array, want: mx.array) -> float:
    """Largest ``|got - want|`` relative to the largest ``|want|`` (float32 comparison)."""
    diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()
    return float(diff.item() / max(float(mx.abs(want.astype(mx.float32)).max().item()), 1e-30))


def kernel_for(rows: int) -> str:
    """The kernel that a timed row of ``rows`` activation rows runs: zp_qmv or zp_qmm."""
    return "zp_qmv" if rows == 1 else "zp_qmm"


def measure_choice(n: int = 4096, k: int = 4096, bits=(4, 8), group_sizes=(32, 64, 128),
                   rows=MEASURED_ROWS, iters: int = 10, skip: dict[str, str] | None = None,
                   working_set_mb: int = 256) -> list[dict]:
    """Time ``zp_qmv`` (1 row) and ``zp_qmm`` (2-16 rows) against ``mx.quantized_matmul`` on an
    (n, k) layer for each bits, group size and row count, and save the speedups of the rows
    that ran and agreed with the fallback where :func:`mlxspec.quant.kernels.route` reads them.

    ``skip``: kernel name -> why it is not timed (it failed its check); those rows say so.
    Emulated, nothing is saved. Returns the :func:`benchmark_matmul` rows.
    """
    skip = skip or {}
    timings = []
    for b in bits:
        for g in group_sizes:
            for m in rows:
                kernel = kernel_for(m)
                if kernel in skip:
                    timings.append({"n": n, "k": k, "bits": b, "group_size": g, "rows": m,
                                    "path": kernel, "skipped": skip[kernel]})
                    continue
                try:
                    timings.append(benchmark_matmul(n, k, bits=b, group_size=g, rows=m,
                                                    iters=iters, working_set_mb=working_set_mb))
                except Exception as e:  # noqa: BLE001  (a report line: the other rows still run)
                    timings.append({"n": n, "k": k, "bits": b, "group_size": g, "rows": m,
                                    "path": kernel, "error": first_line(e)})
    measured = [t for t in timings if t.get("ok")]
    if measured and not emulating():
        save_qmm_choice([{key: t[key] for key in ("bits", "group_size", "rows", "speedup")}
                         for t in measured])
    return timings


def first_line(e: Exception) -> str:
    """An exception's first line (a Metal compile error is many lines)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def gpu_copy_bandwidth(megabytes: int = 256, iters: int = 10) -> float:
    """GB/s of a GPU copy (read + write), median of ``iters``: the roofline for decode."""
    a = mx.random.uniform(shape=(megabytes * 2**18,))
    mx.eval(a)
    times = []
    for _ in range(iters + 2):
        start = time.perf_counter()
        mx.eval(mx.array(a * 1.0))
        times.append(time.perf_counter() - start)
    return 2 * a.nbytes / float(np.median(times[2:])) / 1e9


def benchmark_matmul(
    n: int,
    k: int,
    *,
    bits: int,
    group_size: int,
    rows: int,
    dtype=mx.float16,
    scale_dtype=mx.float16,
    iters: int = 20,
    working_set_mb: int = 256,
) -> dict:
    """Time the kernel for ``rows`` (``zp_qmv`` for 1, ``zp_qmm`` for 2-16) against
    ``mx.quantized_matmul`` (MLX affine, same bits and group size), and compare the kernel's
    output on the first layer with the fallback on the same weights.

    Each timed pass multiplies the same activations by enough distinct random layers to read
    ``working_set_mb`` of weights, like a forward pass (one layer alone would sit in the cache).
    GB/s counts the bytes each path must move: packed weight, scales, zeros or biases, x and y.

    Returns the shape, ``zp_us`` / ``affine_us`` (microseconds per layer), ``zp_gbps`` /
    ``affine_gbps``, ``speedup`` (affine time / zero-point time), ``max_rel_error`` and ``ok``
    (the comparison), and ``emulated`` (the times are then CPU emulation).
    """
    if not 1 <= rows <= QMM_MAX_ROWS:
        raise ValueError(f"the kernels take 1-{QMM_MAX_ROWS} rows, not {rows}")
    groups = k // group_size
    weight_bytes = n * k * bits // 8
    layers = max(2, min(64, working_set_mb * 2**20 // weight_bytes))
    io_bytes = (rows * k + rows * n) * dtype.size
    zp_bytes = (weight_bytes + n * groups * scale_dtype.size
                + n * zp_format.packed_cols(groups, bits) * 4 + io_bytes)
    affine_bytes = weight_bytes + 2 * n * groups * 2 + io_bytes
    x = mx.random.normal((rows, k)).astype(dtype)

    def random_scales(to=mx.float16):
        return (mx.random.uniform(shape=(n, groups)) * 0.02 + 1e-3).astype(to)

    zp_layers, affine_layers = [], []
    for _ in range(layers):
        weight = random_words((n, k * bits // 32))  # random codes = random bits
        zeros = random_words((n, zp_format.packed_cols(groups, bits)))
        zp_layers.append((weight, random_scales(scale_dtype), zeros))
        affine_layers.append((weight, random_scales(), random_scales()))
    mx.eval(x, zp_layers, affine_layers)
    kernel = metal_qmv if rows == 1 else metal_qmm

    def zp(layer):
        return kernel(x, *layer, bits=bits, group_size=group_size)

    def affine(layer):
        return mx.quantized_matmul(x, *layer, transpose=True, group_size=group_size, bits=bits)

    error = relative_error(zp(zp_layers[0]), fallback_matmul(x, *zp_layers[0], bits=bits,
                                                             group_size=group_size))
    zp_s = _seconds_per_layer(zp, zp_layers, iters)
    affine_s = _seconds_per_layer(affine, affine_layers, iters)
    return {
        "n": n,
        "k": k,
        "bits": bits,
        "group_size": group_size,
        "rows": rows,
        "path": kernel_for(rows),
        "dtype": str(dtype).split(".")[-1],
        "scale_dtype": str(scale_dtype).split(".")[-1],
        "zp_us": zp_s * 1e6,
        "affine_us": affine_s * 1e6,
        "zp_gbps": zp_bytes / zp_s / 1e9,
        "affine_gbps": affine_bytes / affine_s / 1e9,
        "speedup": affine_s / zp_s,
        "max_rel_error": error,
        "ok": bool(error <= TOLERANCE[dtype]),
        **({"emulated": EMULATED} if emulating() else {}),
    }


def random_words(shape: tuple[int, int]) -> mx.array:
    """Uniformly random uint32 words (random codes for any bit width)."""
    low, high = (mx.random.randint(0, 1 << 16, shape).astype(mx.uint32) for _ in range(2))
    return low | (high << 16)


def _seconds_per_layer(fn, layers: list, iters: int) -> float:
    """Median time of one pass of ``fn`` over all ``layers`` (evaluated together), per layer."""

    def one_pass():
        mx.eval([fn(layer) for layer in layers])

    for _ in range(min(3, iters)):
        one_pass()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / len(layers)
