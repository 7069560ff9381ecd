"""What MLX's CPU backend's BLAS is in this process: the library MLX's calls end up in, its
version and threads, the shim's routes, and (on request) a measured matmul GFLOP/s.
``mlxspec doctor`` and the benchmarks record it (:func:`blas_report`)."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

from mlxspec.cpu import blas
from mlxspec.cpu.blas import OPENBLAS_PACKAGE, OPENBLAS_PREFIX


def resolved_library(symbol: str = "cblas_sgemm") -> str | None:
    """The file defining the ``symbol`` that MLX's ``libmlx.so`` binds to (imports ``mlx.core``).

    Follows the dynamic linker's order: the global scope first (where the shim sits), then
    libmlx.so's own dependencies (the bundled reference BLAS). None if neither defines it.
    """
    import mlx.core as mx

    libmlx = Path(mx.__file__).parent / "lib" / "libmlx.so"
    found = blas._global_definition(symbol)
    if found is None and libmlx.is_file():
        found = blas._defining_file(ctypes.CDLL(str(libmlx))._handle, symbol)
    return found


def measure_matmul_gflops(n: int = 512, repeats: int = 5) -> float:
    """Best-of-``repeats`` GFLOP/s of an (n, n) @ (n, n) float32 matmul on MLX's CPU stream."""
    import mlx.core as mx

    a = mx.random.normal((n, n), stream=mx.cpu)
    b = mx.random.normal((n, n), stream=mx.cpu)
    mx.eval(mx.matmul(a, b, stream=mx.cpu))  # warm up (thread pools, allocator)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def _library_info(library: str, prefix: str) -> dict:
    """OpenBLAS version string and thread count, when the library exposes them."""
    info = {}
    lib = ctypes.CDLL(library, mode=os.RTLD_LOCAL)  # already loaded: same handle, stays private
    for key, name, restype in (
        ("config", "openblas_get_config", ctypes.c_char_p),
        ("threads", "openblas_get_num_threads", ctypes.c_int),
    ):
        try:
            function = getattr(lib, prefix + name)
        except AttributeError:
            continue
        function.restype = restype
        value = function()
        info[key] = value.decode() if isinstance(value, bytes) else value
    return info


def blas_report(measure: bool = True) -> dict:
    """Which BLAS MLX's CPU backend uses, and (``measure=True``) its float32 matmul GFLOP/s.

    Keys: ``requested`` (MLXSPEC_BLAS), ``active`` ("openblas", "custom", "preloaded",
    "reference", "accelerate"), ``library`` (where MLX's calls end up), ``shim``, ``resolved`` (file that
    defines the ``cblas_sgemm`` MLX binds), ``version``/``config``/``threads`` when known,
    ``notice`` (why the reference BLAS is in use), ``matmul_gflops`` (512x512 float32).
    """
    blas.setup()
    state = blas._state
    report = {
        "requested": state.requested,
        "active": state.active,
        "library": state.library,
        "shim": state.shim,
    }
    if state.active == "openblas":
        import importlib.metadata

        report["version"] = f"{OPENBLAS_PACKAGE} {importlib.metadata.version(OPENBLAS_PACKAGE)}"
    if state.library:
        prefix = OPENBLAS_PREFIX if state.active == "openblas" else ""
        report.update(_library_info(state.library, prefix))
    if measure:
        report["matmul_gflops"] = round(measure_matmul_gflops(), 1)
    if sys.platform == "linux":
        report["resolved"] = resolved_library()
        report["forwarded_calls"] = blas.forwarded_calls()
        report["skinny_products"] = blas.skinny_products()
        report["product_routes"] = blas.product_routes()
    report["notice"] = state.notice
    return report
