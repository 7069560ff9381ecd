"""Zero-point matmul: the Metal kernels in ``metal/*.metal`` where Metal is available, an MLX
fallback elsewhere.

``zp_matmul(x, weight, scales, zeros, bits=..., group_size=...)`` computes ``x @ W.T`` for a weight
in the format of :mod:`mlxspec.quant.format`. On Metal it dispatches by the number of activation
rows M:

- M = 1: ``zp_qmv`` (decode): fused dequantize + mat-vec, simdgroup reductions;
- 2 <= M <= 16: ``zp_qmm`` (speculative verification, short prefills): each weight read once for
  all rows;
- M > 16: ``zp_dequantize`` to ``x.dtype``, then ``mx.matmul``.

Elsewhere (Linux, or ``MLXSPEC_KERNELS=mlx``) it uses the lossless affine form
(:func:`mlxspec.quant.format.to_mlx_affine`) through ``mx.quantized_matmul``; pass ``biases``
precomputed once to avoid rebuilding them on every call.

Every kernel launch goes through :func:`_launch`, so the test suite's emulator can run the exact
Metal source MLX generates on a CPU (``tests/metal_emu``).
"""

from __future__ import annotations

import functools
import os
import time
from importlib import resources

import mlx.core as mx
import numpy as np

from mlxspec.errors import MlxspecError, QuantizationError
from mlxspec.quant import format

QMM_MAX_ROWS = 16
_QMM_CAPACITIES = (4, 8, 16)

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


def describe() -> str:
    """One line for ``mlxspec doctor``: which zero-point matmul path is active and why."""
    if backend() == "metal":
        return (
            "zero-point kernels: Metal (qmv for 1 row, qmm for 2-16 rows, "
            "dequantize + matmul above) from mlxspec.metal"
        )
    why = "MLXSPEC_KERNELS=mlx" if mx.metal.is_available() else "Metal is not available"
    return f"zero-point kernels: MLX fallback (exact affine form via mx.quantized_matmul; {why})"


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
    format.check_spec(bits, group_size, k)
    if weight.dtype != mx.uint32 or zeros.dtype != mx.uint32:
        raise QuantizationError("zero-point weight and zeros must be uint32: re-quantize the model")
    if scales.dtype not in (mx.float16, mx.bfloat16):
        raise QuantizationError(f"scales must be float16 or bfloat16, not {scales.dtype}")
    if scales.shape != (n, k // group_size) or zeros.shape != (
        n,
        format.packed_cols(k // group_size, bits),
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
    """Dense weight ``(N, K)`` of ``dtype`` on the GPU; equals :func:`format.dequantize`."""
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
    x: mx.array, weight: mx.array, scales: mx.array, zeros: mx.array, *, bits: int, group_size: int
) -> mx.array:
    """``x @ W.T`` with the Metal kernels. x: (..., K) float16/bfloat16/float32 -> (..., N)."""
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
    elif m <= QMM_MAX_ROWS:
        capacity = next(c for c in _QMM_CAPACITIES if c >= m)
        rows_per_simdgroup = 4 if capacity <= 8 else 2
        y = _launch(
            "zp_qmm",
            inputs=[rows, weight, scales, zeros, m, k, n],
            template=_template(x.dtype, bits, group_size, BM=capacity),
            grid=(32, (n + rows_per_simdgroup - 1) // rows_per_simdgroup, 1),
            threadgroup=(32, 4, 1),
            output_shapes=[(m, n)],
            output_dtypes=[x.dtype],
        )[0]
    else:
        w = metal_dequantize(weight, scales, zeros, bits=bits, group_size=group_size, dtype=x.dtype)
        y = rows @ w.T
    return y.reshape(*x.shape[:-1], n)


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

    ``biases``: float32 ``-s*z`` from :func:`format.to_mlx_affine`, computed here when omitted.
    """
    if biases is None:
        _, _, biases = format.to_mlx_affine(weight, scales, zeros, bits, group_size)
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
        weight, scales, zeros: the layer in :mod:`mlxspec.quant.format` layout, W is ``(N, K)``.
        biases: precomputed float32 affine biases for the fallback (ignored by the kernels).

    Returns:
        ``(..., N)`` in ``x.dtype``, accumulated in float32.
    """
    if backend() == "metal":
        return metal_matmul(x, weight, scales, zeros, bits=bits, group_size=group_size)
    return fallback_matmul(
        x, weight, scales, zeros, bits=bits, group_size=group_size, biases=biases
    )


def check_on_device(seed: int = 0, timing: bool = True) -> dict:
    """Run every kernel on the GPU against the MLX fallback (for ``mlxspec doctor --kernels``).

    Returns ``{"ok": bool, "cases": [...], "timing": [...]}``: one case per (path, bits, group
    size, dtype) with the largest error relative to the output's magnitude, and (``timing``) the
    4096x4096 4-bit matmul timed against ``mx.quantized_matmul`` at 1 and 8 rows
    (:func:`benchmark_matmul`). Raises MlxspecError where Metal is not available.
    """
    if not mx.metal.is_available():
        raise MlxspecError("the kernel check needs Metal: run it on a Mac with Apple silicon")
    rng = np.random.default_rng(seed)
    cases = []
    for bits in format.SUPPORTED_BITS:
        for group_size in format.SUPPORTED_GROUP_SIZES:
            n, k = 300, 9 * group_size  # neither a multiple of the row tiles nor of the K steps
            weight, scales, zeros = _random_layer(rng, n, k, bits, group_size)
            want = format.dequantize(weight, scales, zeros, bits, group_size, dtype=mx.float32)
            got = metal_dequantize(
                weight, scales, zeros, bits=bits, group_size=group_size, dtype=mx.float32
            )
            cases.append(_case("dequantize", bits, group_size, mx.float32, got, want))
            for dtype in _FLOAT_TYPES:
                # bfloat16 models come with bfloat16 scales.
                layer = (weight, scales.astype(dtype) if dtype == mx.bfloat16 else scales, zeros)
                _, _, biases = format.to_mlx_affine(*layer, bits, group_size)
                for m in (1, 3, 8, 16, 33):
                    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
                    want = fallback_matmul(
                        x, *layer, bits=bits, group_size=group_size, biases=biases
                    )
                    got = metal_matmul(x, *layer, bits=bits, group_size=group_size)
                    cases.append(_case(f"{_path(m)} M={m}", bits, group_size, dtype, got, want))
    report = {"ok": all(c["ok"] for c in cases), "cases": cases}
    if timing:
        report["timing"] = [
            benchmark_matmul(4096, 4096, bits=4, group_size=64, rows=m, iters=10) for m in (1, 8)
        ]
    return report


def _path(m: int) -> str:
    return "qmv" if m == 1 else "qmm" if m <= QMM_MAX_ROWS else "dequantize+matmul"


def _random_layer(rng: np.random.Generator, n: int, k: int, bits: int, group_size: int):
    """A random zero-point layer (uint32 weight, float16 scales, uint32 zeros) as mx arrays."""
    q = rng.integers(0, 2**bits, (n, k))
    z = rng.integers(0, 2**bits, (n, k // group_size))
    s = (rng.random((n, k // group_size)) * 0.02 + 0.001).astype(np.float16)
    return mx.array(format.pack(q, bits)), mx.array(s), mx.array(format.pack(z, bits))


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
    zp_bytes = weight_bytes + n * groups * 2 + n * format.packed_cols(groups, bits) * 4 + io_bytes
    affine_bytes = weight_bytes + 2 * n * groups * 2 + io_bytes
    x = mx.random.normal((rows, k)).astype(dtype)

    def random_scales():
        return (mx.random.uniform(shape=(n, groups)) * 0.02).astype(mx.float16)

    zp_layers, affine_layers = [], []
    for _ in range(layers):
        weight = _random_words((n, k * bits // 32))  # random codes = random bits
        zeros = _random_words((n, format.packed_cols(groups, bits)))
        zp_layers.append((weight, random_scales(), zeros))
        affine_layers.append((weight, random_scales(), random_scales()))
    mx.eval(x, zp_layers, affine_layers)

    def zp(layer):
        return metal_matmul(x, *layer, bits=bits, group_size=group_size)

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
