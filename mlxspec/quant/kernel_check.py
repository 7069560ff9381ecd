"""Diagnostics of the zero-point kernels on a Mac, for ``mlxspec doctor --kernels`` and
``bench/kernels.py``: every kernel against the MLX fallback (each case caught on its own, so a
Metal compile error is a report line, not a traceback), the matmul timed against
``mx.quantized_matmul``, and the GPU's copy bandwidth."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from mlxspec.errors import MlxspecError
from mlxspec.quant import zp_format
from mlxspec.quant.kernels import (
    _FLOAT_TYPES,
    QMM_MAX_ROWS,
    QMM_MEASURED_ROWS,
    fallback_matmul,
    metal_dequantize,
    metal_matmul,
    metal_qmm,
    qmm_choice_path,
    save_qmm_choice,
)


def check_on_device(seed: int = 0, timing: bool = True) -> dict:
    """Run every kernel on the GPU against the MLX fallback (for ``mlxspec doctor --kernels``).

    Returns ``{"ok": bool, "cases": [...], "timing": [...]}``: one case per (path, bits, group
    size, dtype) with the largest error relative to the output's magnitude, and (``timing``) the
    4096x4096 4-bit matmul timed against ``mx.quantized_matmul``
    (:func:`benchmark_matmul`) at 1 row, and ``zp_qmm`` at 2-16 rows
    (:func:`measure_qmm_choice`, which saves where it wins). Raises MlxspecError where Metal is
    not available.
    """
    if not mx.metal.is_available():
        raise MlxspecError("the kernel check needs Metal: run it on a Mac with Apple silicon")
    rng = np.random.default_rng(seed)
    cases = []
    for bits in zp_format.SUPPORTED_BITS:
        for group_size in zp_format.SUPPORTED_GROUP_SIZES:
            n, k = 300, 9 * group_size  # neither a multiple of the row tiles nor of the K steps
            weight, scales, zeros = _random_layer(rng, n, k, bits, group_size)
            want = zp_format.dequantize(weight, scales, zeros, bits, group_size, dtype=mx.float32)
            cases.append(_caught("dequantize", bits, group_size, mx.float32, want,
                                 metal_dequantize, weight, scales, zeros, bits=bits,
                                 group_size=group_size, dtype=mx.float32))
            for dtype in _FLOAT_TYPES:
                # bfloat16 models come with bfloat16 scales.
                layer = (weight, scales.astype(dtype) if dtype == mx.bfloat16 else scales, zeros)
                _, _, biases = zp_format.to_mlx_affine(*layer, bits, group_size)
                for m in (1, 3, 8, 16, 33):
                    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
                    want = fallback_matmul(
                        x, *layer, bits=bits, group_size=group_size, biases=biases
                    )
                    cases.append(_caught(f"matmul M={m}", bits, group_size, dtype, want,
                                         metal_matmul, x, *layer, bits=bits,
                                         group_size=group_size))
                    if 1 < m <= QMM_MAX_ROWS:
                        cases.append(_caught(f"zp_qmm M={m}", bits, group_size, dtype, want,
                                             metal_qmm, x, *layer, bits=bits,
                                             group_size=group_size))
    report = {"ok": all(c["ok"] for c in cases), "cases": cases}
    if timing:
        report["timing"] = [benchmark_matmul(4096, 4096, bits=4, group_size=64, rows=1, iters=10)]
        report["qmm_timing"] = measure_qmm_choice()
        report["qmm_choice_saved"] = str(qmm_choice_path())
        report["gpu_copy_gbps"] = gpu_copy_bandwidth()
    return report


def measure_qmm_choice(n: int = 4096, k: int = 4096, bits=(4, 8), group_sizes=(32, 64, 128),
                       rows=QMM_MEASURED_ROWS, iters: int = 10) -> list[dict]:
    """Time ``zp_qmm`` against ``mx.quantized_matmul`` on an (n, k) layer for each bits, group
    size and row count, and save the speedups where :func:`metal_matmul` reads them
    (:func:`mlxspec.quant.kernels.use_zp_qmm`): zp_qmm then runs only where it was measured
    faster on this device. Returns the :func:`benchmark_matmul` rows."""
    timings = [benchmark_matmul(n, k, bits=b, group_size=g, rows=m, iters=iters)
               for b in bits for g in group_sizes for m in rows]
    save_qmm_choice([{key: t[key] for key in ("bits", "group_size", "rows", "speedup")}
                     for t in timings])
    return timings


def _caught(path: str, bits: int, group_size: int, dtype, want: mx.array, fn, /, *args, **kwargs
            ) -> dict:
    """One case of :func:`check_on_device`; a failure (e.g. a Metal compile error) becomes a
    case with ``ok: False`` and its one-line ``error``."""
    try:
        got = fn(*args, **kwargs)
        mx.eval(got)
    except Exception as e:  # noqa: BLE001  (reported, not raised: the other cases still run)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return {"path": path, "bits": bits, "group_size": group_size,
                "dtype": str(dtype).split(".")[-1], "ok": False, "error": first}
    return _case(path, bits, group_size, dtype, got, want)


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


def _path(m: int) -> str:
    return "qmv" if m == 1 else "qmm" if m <= QMM_MAX_ROWS else "affine"


def _random_layer(rng: np.random.Generator, n: int, k: int, bits: int, group_size: int):
    """A random zero-point layer (uint32 weight, float16 scales, uint32 zeros) as mx arrays."""
    q = rng.integers(0, 2**bits, (n, k))
    z = rng.integers(0, 2**bits, (n, k // group_size))
    s = (rng.random((n, k // group_size)) * 0.02 + 0.001).astype(np.float16)
    return mx.array(zp_format.pack(q, bits)), mx.array(s), mx.array(zp_format.pack(z, bits))


def _case(path: str, bits: int, group_size: int, dtype, got: mx.array, want: mx.array) -> dict:
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    tolerance = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}[dtype]
    return {
        "path": path,
        "bits": bits,
        "group_size": group_size,
        "dtype": str(dtype).split(".")[-1],
        "max_rel_error": err,
        "ok": bool(err <= tolerance),
    }


def benchmark_matmul(
    n: int,
    k: int,
    *,
    bits: int,
    group_size: int,
    rows: int,
    dtype=mx.float16,
    iters: int = 20,
    working_set_mb: int = 256,
) -> dict:
    """Time ``metal_matmul`` against ``mx.quantized_matmul`` (MLX affine, same bits and group size).

    Each timed pass multiplies the same activations by enough distinct random layers to read
    ``working_set_mb`` of weights, like a forward pass (one layer alone would sit in the cache).
    GB/s counts the bytes each path must move: packed weight, scales, zeros or biases, x and y.

    Returns the shape, ``zp_us`` / ``affine_us`` (microseconds per layer), ``zp_gbps`` /
    ``affine_gbps`` and ``speedup`` (affine time / zero-point time).
    """
    groups = k // group_size
    weight_bytes = n * k * bits // 8
    layers = max(2, min(64, working_set_mb * 2**20 // weight_bytes))
    io_bytes = (rows * k + rows * n) * dtype.size
    zp_bytes = weight_bytes + n * groups * 2 + n * zp_format.packed_cols(groups, bits) * 4 + io_bytes
    affine_bytes = weight_bytes + 2 * n * groups * 2 + io_bytes
    x = mx.random.normal((rows, k)).astype(dtype)

    def random_scales():
        return (mx.random.uniform(shape=(n, groups)) * 0.02).astype(mx.float16)

    zp_layers, affine_layers = [], []
    for _ in range(layers):
        weight = _random_words((n, k * bits // 32))  # random codes = random bits
        zeros = _random_words((n, zp_format.packed_cols(groups, bits)))
        zp_layers.append((weight, random_scales(), zeros))
        affine_layers.append((weight, random_scales(), random_scales()))
    mx.eval(x, zp_layers, affine_layers)

    def zp(layer):
        if rows == 1:
            return metal_matmul(x, *layer, bits=bits, group_size=group_size)
        return metal_qmm(x, *layer, bits=bits, group_size=group_size)

    def affine(layer):
        return mx.quantized_matmul(x, *layer, transpose=True, group_size=group_size, bits=bits)

    zp_s = _seconds_per_layer(zp, zp_layers, iters)
    affine_s = _seconds_per_layer(affine, affine_layers, iters)
    return {
        "n": n,
        "k": k,
        "bits": bits,
        "group_size": group_size,
        "rows": rows,
        "path": _path(rows),
        "dtype": str(dtype).split(".")[-1],
        "zp_us": zp_s * 1e6,
        "affine_us": affine_s * 1e6,
        "zp_gbps": zp_bytes / zp_s / 1e9,
        "affine_gbps": affine_bytes / affine_s / 1e9,
        "speedup": affine_s / zp_s,
    }


def _random_words(shape: tuple[int, int]) -> mx.array:
    """Uniformly random uint32 words."""
    low, high = (mx.random.randint(0, 1 << 16, shape).astype(mx.uint32) for _ in range(2))
    return low | (high << 16)


def _seconds_per_layer(fn, layers: list, iters: int) -> float:
    """Median time of one pass of ``fn`` over all ``layers`` (evaluated together), per layer."""

    def one_pass():
        mx.eval([fn(layer) for layer in layers])

    for _ in range(3):
        one_pass()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / len(layers)
