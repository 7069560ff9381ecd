"""MLX's CPU JIT kernels built for the CPU they run on: the same bits, vectorized.

``mx.compile`` on MLX's CPU back-end writes each fused elementwise kernel as C++ and builds it
with ``g++ -std=c++17 -O3`` (cached in ``<temp dir>/mlx/<version>/cpu``). MLX adds
``-mavx2 -mfma -mf16c`` only when MLX itself was built for AVX2, which the Linux wheel on PyPI is
not: its kernels target baseline x86-64, where every ``std::fma`` of MLX's ``exp`` is a libm call
and no loop containing one vectorizes. SwiGLU's SiLU (``mx.sigmoid``, compiled by mlx-lm) then
costs ~18 ns per element, ~6.6 ms of a SmolLM2 decode step over 8 rows on 2 vCPUs.

``enable()`` restores what MLX does on an AVX2 build, plus what lets GCC vectorize MLX's ``exp``:
it puts a ``g++`` wrapper first on ``PATH`` that adds ``FLAGS`` to MLX's JIT builds (a command
writing into ``*/mlx/*/cpu/``) and passes every other command through unchanged (and every
command, where the switches below are set: child processes inherit the ``PATH``). None of the
flags changes a result: ``-mfma`` computes the same correctly rounded ``fma``,
``-ffp-contract=off`` forbids fusing anything the source does not fuse, ``-fno-math-errno`` and
``-fno-trapping-math`` only drop errno and floating-point trap semantics (which let GCC
if-convert and vectorize the loops), ``-fno-strict-aliasing`` keeps MLX's type-punned bit
tricks well defined, ``-finline-limit`` lets ``exp`` inline into the loop. SiLU: ~1.1 ns per
element, bitwise the same (``tests/cpu/test_cpu_jit.py``).

MLX finds a kernel it built before by name and does not build it again, so kernels already in
the cache would keep the old build: the first ``enable()`` for a cache directory and set of flags
removes the kernels in it (a stamp file there records the flags); MLX rebuilds those it needs,
~0.5 s each. ``mlxspec.load`` enables it before it builds the model, since building can already
compile kernels.

Process-wide, like :mod:`mlxspec.cpu.fused_ops` (whose switch it shares: ``MLXSPEC_FUSED_OPS=0``
leaves MLX's build alone; ``MLXSPEC_JIT_FLAGS=0`` only this, for A/B runs). Only on Linux x86-64 CPUs with AVX2, FMA and F16C, with ``g++``, and
where Metal is unavailable.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx

from mlxspec.switches import turned_off

FLAGS = ("-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fno-math-errno",
         "-fno-trapping-math", "-fno-strict-aliasing", "-finline-limit=2000")
CPU_FEATURES = ("avx2", "fma", "f16c")
STAMP = ".mlxspec-jit-flags"  # in MLX's kernel directory: its kernels were cleared once

_WRAPPER = """#!/bin/sh
# Written by mlxspec (mlxspec/cpu/jit.py): MLX's CPU JIT kernels built for this CPU's AVX2/FMA.
# Child processes inherit PATH: their switches are read here, at each build.
off() {{
  case "$(printf %s "$1" | tr -d ' ' | tr A-Z a-z)" in 0|off|false|no) return 0 ;; esac
  return 1
}}
if off "$MLXSPEC_JIT_FLAGS" || off "$MLXSPEC_FUSED_OPS"; then exec {compiler} "$@"; fi
out=
prev=
for arg in "$@"; do
  [ "$prev" = "-o" ] && out=$arg
  prev=$arg
done
case "$out" in
  */mlx/*/cpu/*) exec {compiler} "$@" {flags} ;;
esac
exec {compiler} "$@"
"""

_wrapper_dir: Path | None = None


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in Linux's ``/proc/cpuinfo`` (``{}`` where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    lines = text.split("\n\n")[0].splitlines()
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lines if ":" in line)}


def _cpu_supported() -> bool:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = cpuinfo().get("flags", "").split()
    return all(feature in flags for feature in CPU_FEATURES)


def kernel_dir() -> Path:
    """Where MLX caches its CPU kernels: C++'s ``temp_directory_path()`` (``TMPDIR``, ``TMP``,
    ``TEMP`` or ``TEMPDIR``, else ``/tmp``), then ``mlx/<version>/cpu``."""
    root = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR")
                 if os.environ.get(v)), "/tmp")
    return Path(root) / "mlx" / mx.__version__ / "cpu"


# mlxspec.cpu.fused_ops's switch (defined here, which it imports): it turns these flags off too.
FUSED_OPS_SWITCH = "MLXSPEC_FUSED_OPS"


def _switched_off() -> bool:
    return turned_off("MLXSPEC_JIT_FLAGS") or turned_off(FUSED_OPS_SWITCH)


def enable() -> bool:
    """Put the ``g++`` wrapper first on ``PATH`` (see the module docstring). Idempotent; returns
    whether MLX's JIT builds get ``FLAGS`` in this process."""
    global _wrapper_dir
    if _wrapper_dir is not None:
        return True
    compiler = shutil.which("g++")
    if _switched_off() or mx.metal.is_available() or not compiler or not _cpu_supported():
        return False
    try:
        wrapper = _write_wrapper(compiler)
        _clear_old_kernels(kernel_dir())
    except OSError:
        return False  # a cache we cannot write: MLX builds as it always does
    _wrapper_dir = wrapper.parent
    os.environ["PATH"] = f"{_wrapper_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return True


def enabled() -> bool:
    return _wrapper_dir is not None


def describe() -> str:
    """What ``mlxspec.load`` does with MLX's JIT builds here (for ``mlxspec doctor``)."""
    if mx.metal.is_available():
        return "not used (Metal)"
    if _wrapper_dir is None and _switched_off():
        return "MLX's default build (MLXSPEC_JIT_FLAGS=0 or MLXSPEC_FUSED_OPS=0)"
    if _wrapper_dir is None and not (shutil.which("g++") and _cpu_supported()):
        return "MLX's default build (needs g++ and a Linux x86-64 CPU with AVX2, FMA and F16C)"
    return f"g++ {' '.join(FLAGS)} for MLX's kernels (bitwise its own build, vectorized)"


def _write_wrapper(compiler: str) -> Path:
    script = _WRAPPER.format(compiler=shlex.quote(compiler), flags=" ".join(FLAGS))
    key = hashlib.sha256(script.encode()).hexdigest()[:12]
    # Beside MLX's own kernel cache, not in MLXSPEC_HOME: a process-lifetime helper that every
    # command writes before it reads its input, so a refused command leaves the user's cache as
    # it was (tests/test_hostile.py). A directory holding nothing else: it goes first on PATH.
    target = kernel_dir().parent / "mlxspec-jit" / key / "g++"
    if target.is_file() and target.read_text() == script:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent)
    with os.fdopen(fd, "w") as f:
        f.write(script)
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target


def _clear_old_kernels(directory: Path) -> None:
    """Remove the kernels MLX built before this cache directory first saw these flags (once per
    set of flags: the stamp file records them)."""
    stamp = directory / STAMP
    recorded = " ".join(FLAGS) + "\n"
    if stamp.is_file() and stamp.read_text() == recorded:
        return
    directory.mkdir(parents=True, exist_ok=True)
    for library in directory.glob("lib*.so"):
        try:
            library.unlink(missing_ok=True)
        except OSError:  # another user's: MLX keeps loading it as built
            pass
    stamp.write_text(recorded)


def cpu_model() -> str:
    """The CPU's name, with its family and model where Linux reports them (cloud machines often
    name only the vendor, "AMD EPYC": the family tells a Zen 5 from a Zen 3): benchmark results
    record it, since the same code runs at different speeds on different machines."""
    import platform

    fields = cpuinfo()
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name
