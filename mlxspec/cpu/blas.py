"""Linux: run MLX's CPU backend on an optimized BLAS instead of the reference one it bundles.

The ``mlx-cpu`` wheel links netlib's reference BLAS/LAPACK (``mlx_cpu.libs/libblas-*.so.3.10``):
a 1024x1024 float32 matmul runs at ~4 GFLOP/s on a 2-core x86 machine, ~150 with OpenBLAS, and a
forward pass of a 135M-parameter float32 model over 8 tokens costs ~8 single-token steps instead
of ~1 (bench/blas.py measures these side by side).

How: ``libmlx.so`` leaves ``cblas_sgemm`` & co. undefined, and the dynamic linker binds them in the
global scope before MLX's own dependencies. So :func:`setup` (run by ``import mlxspec``, before
anything imports ``mlx.core``) loads a small forwarding library with ``RTLD_GLOBAL``: the shim
``_blas_shim.c`` defines exactly the BLAS/LAPACK names MLX imports and forwards them to the
``scipy_``-prefixed ones of PyPI's ``scipy-openblas32`` (BSD, ~25 MB, one ``DYNAMIC_ARCH`` build
for Intel, AMD and ARM CPUs), which it opens privately. The shim is compiled once with the system
C compiler into ``$MLXSPEC_HOME/blas/`` (cache keyed by its source and the CPU architecture).
Without a compiler or scipy-openblas32, MLX stays on the reference BLAS with one warning.

Decoding multiplies a few rows of activations by each weight matrix. OpenBLAS's sgemm packs the
whole weight matrix before such a product, reading and writing it twice to use it once, so the
shim computes these skinny products itself (on OpenBLAS's thread count; an AVX-512 kernel taking
12 rows at once, else AVX2/FMA taking 8, and products of up to 24 rows in groups of those over each
cached block of weights; one row elsewhere goes to sgemv), prefetching the next weight rows as it
goes: a float32 SmolLM2 forward over 1 / 8 / 16 tokens costs 30 / 49 / 76 ms instead of 61 / 79 /
101 with sgemm (``bench/results/blas.json``). ``MLXSPEC_SKINNY=0`` sends every
product to sgemm, ``MLXSPEC_SKINNY=avx2`` keeps to the AVX2 kernel, ``MLXSPEC_SKINNY_ROWS=N``
sends products of more than N rows to sgemm (benchmarks).

``MLXSPEC_BLAS`` chooses:

    unset, "auto", "openblas"   scipy-openblas32 through the shim (default)
    "reference"                 leave MLX on its bundled reference BLAS (no shim, no warning)
    "/path/to/libfoo.so"        a library exporting the standard names (cblas_sgemm, sgeev_, ...),
                                e.g. MKL's libmkl_rt.so.2 or a system libopenblas.so.0

A BLAS already in the global scope (``LD_PRELOAD=libmkl_rt.so``) is left alone ("preloaded").
OpenBLAS runs on the cores other processes leave free (:func:`default_threads`) unless
``OPENBLAS_NUM_THREADS`` is set. float16/bfloat16 matmuls and ``quantized_matmul`` do not use BLAS in MLX, so only float32 (and float64/complex64) work speeds
up. macOS is untouched: MLX uses Accelerate there.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from mlxspec import paths

SHIM_SOURCE = Path(__file__).with_name("_blas_shim.c")
OPENBLAS_PACKAGE = "scipy-openblas32"
OPENBLAS_PREFIX = "scipy_"  # scipy-openblas32 exports scipy_cblas_sgemm, scipy_sgeev_, ...
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
# /proc/loadavg snapshots, 1 ms apart, whose fewest busy cores sizes the threads
SNAPSHOTS = 3


@dataclass
class BlasState:
    """What :func:`setup` did in this process."""

    requested: str  # MLXSPEC_BLAS as given ("auto" when unset)
    active: str = "reference"  # "openblas", "custom", "preloaded", "reference" or "accelerate"
    library: str | None = None  # the optimized library MLX's calls end up in
    shim: str | None = None  # the compiled forwarding library
    notice: str | None = None  # why MLX stays on the reference BLAS, when it does
    auto_threads: bool = False  # threads sized from the idle cores (no thread variable set)
    refreshed: bool = False  # refresh_threads() has sized them again


_state: BlasState | None = None
_shim: ctypes.CDLL | None = None


class _Unavailable(Exception):
    """The optimized BLAS cannot be set up; the message says why and how to fix it."""


def setup() -> None:
    """Make MLX's CPU backend use an optimized BLAS; call before ``mlx.core`` is imported.

    Idempotent. Never raises: when it cannot help, MLX keeps its reference BLAS and one warning
    says why. See the module docstring for ``MLXSPEC_BLAS``.
    """
    global _state
    if _state is not None:
        return
    requested = os.environ.get("MLXSPEC_BLAS", "").strip() or "auto"
    _state = BlasState(requested=requested)
    if sys.platform != "linux":
        _state.active = "accelerate" if sys.platform == "darwin" else "reference"
        return
    if requested == "reference":
        return
    preloaded = _global_definition("cblas_sgemm")
    if preloaded:  # LD_PRELOAD, or a library loaded with RTLD_GLOBAL: MLX binds to that one
        _state.active, _state.library = "preloaded", preloaded
        return
    if "mlx.core" in sys.modules:
        _notice(
            "mlx.core was imported before mlxspec, so MLX keeps its slow reference BLAS; "
            "import mlxspec first (or set MLXSPEC_BLAS=reference to silence this)"
        )
        return
    try:
        threads = _threads_from_environment() or default_threads()
        if requested in ("auto", "openblas"):
            library = _openblas_library()
            _activate(library, OPENBLAS_PREFIX, "openblas")
            if not any(variable in os.environ for variable in THREAD_VARIABLES):
                _set_openblas_threads(threads)
                _state.auto_threads = True
        else:
            _activate(Path(requested).expanduser(), "", "custom")
        _shim.mlxspec_blas_set_threads(threads)  # the shim's own skinny-product kernel
        skinny = os.environ.get("MLXSPEC_SKINNY", "").strip().lower()
        if skinny in ("0", "off", "false", "no"):
            _shim.mlxspec_blas_set_routing(0)  # every product to the library's sgemm
        elif skinny == "avx2":
            _shim.mlxspec_blas_set_isa(b"avx2")  # the AVX2 kernel even where AVX-512 runs
        rows = os.environ.get("MLXSPEC_SKINNY_ROWS", "").strip()
        if rows.isdigit():  # products of at most this many rows to the kernel (benchmarks)
            _shim.mlxspec_blas_set_max_rows(int(rows))
    except _Unavailable as e:
        _notice(f"MLX's CPU backend stays on the slow reference BLAS: {e}")
    except Exception as e:  # a speed-up must never break `import mlxspec`
        _notice(f"MLX's CPU backend stays on the slow reference BLAS: {type(e).__name__}: {e}")


def _set_openblas_threads(threads: int) -> None:
    """OpenBLAS's own thread count (the library :func:`setup` activated: ``_state.library``)."""
    openblas = ctypes.CDLL(_state.library, mode=os.RTLD_LOCAL)  # the shim's handle
    openblas.scipy_openblas_set_num_threads(threads)


def refresh_threads() -> int | None:
    """Size automatically sized threads again from the cores idle now, once per process (the
    first ``mlxspec.load``); returns the count, None without the optimized BLAS.

    At import, the other end of a pipe (``mlxspec bench --json | python ...``) starting up kept
    one of 2 cores busy through every snapshot; by the first load that has passed. Only once:
    OpenBLAS must not change threads while another thread is in a product, as a later load
    could be."""
    if _state is None or _shim is None or _state.active != "openblas":
        return None
    if _state.auto_threads and not _state.refreshed:
        _state.refreshed = True
        threads = default_threads()
        if threads != _shim.mlxspec_blas_threads():
            _set_openblas_threads(threads)
            _shim.mlxspec_blas_set_threads(threads)
    return _shim.mlxspec_blas_threads()


def _threads_from_environment() -> int | None:
    """The thread count OpenBLAS reads from its environment variables, if one is set."""
    for variable in THREAD_VARIABLES:
        try:
            return max(1, int(os.environ[variable]))
        except (KeyError, ValueError):
            continue
    return None


def default_threads() -> int:
    """OpenBLAS threads unless ``OPENBLAS_NUM_THREADS`` says otherwise: the available cores
    that other processes are not using right now (at least 1).

    On an idle 2-core machine both cores decode SmolLM2 17% faster than one (9.8 vs 8.4 tok/s)
    and prefill 40% faster (bench/blas.py). But OpenBLAS workers spin and synchronise on every
    call, so a worker that loses its core to another process stalls the whole matmul: with other
    processes running, 2 threads decoded 7-10x slower than 1. So the threads are sized, when
    mlxspec is imported, to the cores left free by everything else.
    """
    cores = len(os.sched_getaffinity(0))
    return max(1, cores - round(busy_cores_elsewhere()))


def busy_cores_elsewhere() -> float:
    """How many cores other processes keep busy right now, read without waiting: the runnable
    tasks the kernel counts (``/proc/loadavg``, field 4, "running/total") minus this process's
    own running threads; the 1-minute load average where /proc is missing (that one lags).

    The fewest of ``SNAPSHOTS`` snapshots 1 ms apart (~2 ms, where a CPU-time difference would
    need ~50 ms of sleep): a process keeping a core busy shows in every one, one exiting at that
    moment in one (one snapshot gave 1 thread instead of 2 in ~1 of 12 idle imports). Processes
    running in short bursts are missed; they do not stall OpenBLAS's spinning workers for long.
    """
    try:
        busy = []
        for i in range(SNAPSHOTS):
            if i:
                time.sleep(0.001)
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
            busy.append(max(0, running - _own_running_threads()))
        return float(min(busy))
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except OSError:
            return 1.0  # nothing to go on: leave a core for the rest of the system


def _own_running_threads() -> int:
    """Threads of this process in state R (running or runnable); at least 1, the caller."""
    running = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        running += state == "R"
    return max(1, running)


def _notice(message: str) -> None:
    _state.notice = message
    warnings.warn(f"mlxspec: {message}", RuntimeWarning, stacklevel=3)


def _openblas_library() -> Path:
    """Path of scipy-openblas32's shared library, found without importing the package.

    (Importing it would load OpenBLAS with RTLD_GLOBAL, exporting its unprefixed LAPACK helpers.)
    """
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        raise _Unavailable(f"{OPENBLAS_PACKAGE} is not installed (pip install {OPENBLAS_PACKAGE})")
    lib_dir = Path(next(iter(spec.submodule_search_locations))) / "lib"
    libraries = sorted(lib_dir.glob("libscipy_openblas*.so"))
    if not libraries:
        raise _Unavailable(f"no libscipy_openblas*.so in {lib_dir} (reinstall {OPENBLAS_PACKAGE})")
    return libraries[0]


def _activate(library: Path, prefix: str, name: str) -> None:
    """Point the shim at ``library`` privately, then publish the shim to the global scope."""
    global _shim
    if not library.is_file():
        raise _Unavailable(f"MLXSPEC_BLAS={library} is not a file")
    shim_path = shim_library()
    try:
        shim = ctypes.CDLL(str(shim_path), mode=os.RTLD_LOCAL)
    except OSError as e:
        raise _Unavailable(f"cannot load {shim_path} ({e}); delete it to rebuild") from e
    shim.mlxspec_blas_load.restype = ctypes.c_char_p
    shim.mlxspec_blas_load.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    error = shim.mlxspec_blas_load(str(library).encode(), prefix.encode())
    if error is not None:
        raise _Unavailable(error.decode(errors="replace"))
    # Loading an already-loaded library again with RTLD_GLOBAL promotes it to the global scope,
    # where the dynamic linker will find it when mlx.core is imported.
    _shim = ctypes.CDLL(str(shim_path), mode=os.RTLD_GLOBAL)
    _state.active, _state.library, _state.shim = name, str(library), str(shim_path)


def shim_library() -> Path:
    """The compiled shim, built on first use into ``$MLXSPEC_HOME/blas/``.

    Compiled with ``$CC`` (default ``cc``, else ``gcc``); written under a temporary name and
    renamed, so concurrent first imports are safe.
    """
    if not SHIM_SOURCE.is_file():
        raise _Unavailable(f"{SHIM_SOURCE} is missing (reinstall mlxspec)")
    import shlex
    import shutil
    import subprocess
    import tempfile

    source = SHIM_SOURCE.read_bytes()
    key = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:16]
    target = paths.home() / "blas" / f"mlxspec_blas-{key}.so"
    if target.is_file():
        return target
    compiler = shlex.split(os.environ.get("CC", "")) or [
        shutil.which("cc") or shutil.which("gcc") or "cc"
    ]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise _Unavailable(
            f"cannot write {target.parent} ({e.strerror}); set MLXSPEC_HOME to a writable directory"
        ) from e
    command = [*compiler, "-O2", "-shared", "-fPIC", "-pthread", "-o", tmp, str(SHIM_SOURCE),
               "-ldl"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise _Unavailable(
            f"no working C compiler to build the BLAS shim ({e}); install gcc or set CC"
        ) from e
    if result.returncode != 0:
        os.unlink(tmp)
        last_line = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise _Unavailable(f"compiling the BLAS shim failed ({last_line}); install gcc or set CC")
    os.replace(tmp, target)
    return target


def deadline(seconds: float, message: str | None = None) -> bool:
    """End the process ``seconds`` from now with ``message`` on stderr and exit status 2 unless
    called again first (``seconds <= 0`` disarms; ``message`` None keeps the last one), from a
    thread of the shim that needs no GIL. False where the shim is not loaded."""
    if _shim is None:
        return False
    _shim.mlxspec_deadline(ctypes.c_double(seconds), None if message is None else message.encode())
    return True


# -- reporting ------------------------------------------------------------------------------------


def forwarded_calls() -> int | None:
    """How many BLAS/LAPACK calls went through the shim so far (None when it is not active)."""
    if _shim is None:
        return None
    return ctypes.c_ulonglong.in_dll(_shim, "mlxspec_blas_calls").value


def skinny_products() -> str | None:
    """How the shim computes products of a few rows (None when it is not active)."""
    if _shim is None:
        return None
    mode = _shim.mlxspec_blas_skinny_mode()
    if not mode & 1:
        return "off (MLXSPEC_SKINNY=0): every product goes to sgemm"
    if not mode & 2:
        return "one row to sgemv (no AVX2/FMA kernel on this CPU)"
    count = _shim.mlxspec_blas_threads()
    threads = f"{count} thread{'s' * (count > 1)}"
    kernel = "AVX-512 kernel (12 rows at once)" if mode & 4 else "AVX2/FMA kernel (8 rows at once)"
    rows = _shim.mlxspec_blas_max_rows()
    return f"{kernel} for 1-{rows} rows, {threads}; other single rows to sgemv"


def product_routes() -> dict[str, int] | None:
    """How many float32 products the shim computed with its kernels (skinny: 1-24 rows times a
    transposed matrix; nn: times one of <= 256 columns) and sent to sgemv; None if inactive."""
    if _shim is None:
        return None
    return {
        route: ctypes.c_ulonglong.in_dll(_shim, f"mlxspec_blas_{route}_calls").value
        for route in ("skinny", "nn", "gemv")
    }


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _defining_file(handle: int | None, symbol: str) -> str | None:
    """The file that defines ``symbol`` as seen from ``handle`` (None: the global scope)."""
    libdl = ctypes.CDLL(None)
    libdl.dlsym.restype = ctypes.c_void_p
    libdl.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    libdl.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    address = libdl.dlsym(handle, symbol.encode())  # handle None is RTLD_DEFAULT
    info = _DlInfo()
    if not address or not libdl.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def _global_definition(symbol: str) -> str | None:
    return _defining_file(None, symbol)
