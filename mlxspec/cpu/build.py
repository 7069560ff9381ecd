"""Building and loading mlxspec's C++ MLX extensions (the CPU ops, the packed-weight kernel).

Each extension is compiled once per source, MLX/nanobind/Python version, machine and flags into
``$MLXSPEC_HOME/cpu_ops/<key>/`` (``g++`` against the headers MLX's wheel ships and nanobind's
sources, 12-15 s each on a 2-core Xeon). A process needing one builds every extension of the
package that is missing at the same time, one compiler each: a first run pays for the slowest build
rather than for the sum (the default model's first ``generate``: both are built before its first
token). Builds run under a lock and a temporary name, so concurrent first uses build once.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from mlxspec import paths
from mlxspec.cpu import jit as cpu_jit

BUILD_TIMEOUT_S = 600


class Unavailable(Exception):
    """Why an extension cannot be built or used here (reported by the ``describe`` functions)."""


@dataclass(frozen=True)
class Extension:
    """A C++ source of this package built as the Python module ``module_name`` (NB_MODULE's
    name in it), with ``extra_flags()`` added to the common flags; ``wanted()`` says whether this
    process may use it (its switch, the CPU's features): only then is it built beside another."""

    source: Path
    module_name: str
    extra_flags: Callable[[], tuple[str, ...]] = tuple
    wanted: Callable[[], bool] = lambda: True


# The package's extensions, each the EXTENSION of its module: a build starts every missing one.
MODULES = ("mlxspec.cpu.ops", "mlxspec.cpu.quantized")


def _companion_plans(extension: Extension) -> list[tuple[Path, Extension, list[str]]]:
    """The other extensions this process wants, planned; one that cannot even be planned (its
    module, its switch, a missing source) is left for its own first use to report."""
    plans = []
    for name in MODULES:
        try:
            other = importlib.import_module(name).EXTENSION
            if other != extension and other.wanted():
                other_target, other_command = _plan(other)
                plans.append((other_target, other, other_command))
        except Exception:  # noqa: BLE001 (a companion is optional here)
            continue
    return plans


def _nanobind() -> ModuleType:
    try:
        import nanobind
    except ImportError as e:
        raise Unavailable("nanobind is not installed (pip install 'nanobind>=3.1,<3.2')") from e
    return nanobind


def flags() -> list[str]:
    """-ffp-contract=off always (fusing what MLX's build does not fuse would change bits); the JIT
    flags of :mod:`mlxspec.cpu.jit` where the CPU has AVX2 and FMA (they change no result)."""
    common = ["-std=c++20", "-O3", "-fPIC", "-shared", "-fvisibility=hidden", "-DNDEBUG",
              "-DNB_COMPACT_ASSERTIONS", "-DNB_DOMAIN=mlx", "-ffp-contract=off",
              "-fno-strict-aliasing"]
    if cpu_jit._cpu_supported():
        common += [f for f in cpu_jit.FLAGS if f not in common]
    return common


def compiler() -> list[str]:
    """``$CXX``, else the first ``g++`` on ``PATH`` that is not :mod:`mlxspec.cpu.jit`'s wrapper
    (one per cache directory, inherited by child processes: the cache key must not depend on
    which one a process sees)."""
    if os.environ.get("CXX", "").strip():
        return shlex.split(os.environ["CXX"])
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = shutil.which("g++", path=directory) if directory else None
        if candidate is None:
            continue
        try:
            head = Path(candidate).read_bytes()[:200]
        except OSError:
            continue
        if b"mlxspec/cpu/jit.py" not in head:
            return [candidate]
    return ["g++"]


def source_texts(source: Path) -> list[str]:
    """The source's text and that of every header of this directory it includes (``#include
    "_name.h"``, recursively): what the build key must cover."""
    texts, pending, seen = [], [source], set()
    while pending:
        path = pending.pop(0)
        if path in seen:
            continue
        seen.add(path)
        text = path.read_text()
        texts.append(text)
        pending += [source.with_name(name) for name in re.findall(r'^#include "(_\w+\.h)"', text, re.M)]
    return texts


def _plan(extension: Extension) -> tuple[Path, list[str]]:
    """Where ``extension``'s module goes, and the compiler command without its ``-o``."""
    nanobind = _nanobind()
    command = compiler()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    all_flags = [*flags(), *extension.extra_flags()]
    try:
        texts = source_texts(extension.source)
    except OSError as e:
        raise Unavailable(f"{e.filename} is missing (reinstall mlxspec)") from e
    key_text = "\n".join([*texts, mx.__version__, nanobind.__version__,
                          suffix, platform.machine(), *all_flags, *command])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    target = paths.home() / "cpu_ops" / key / f"{extension.module_name}{suffix}"
    mlx_root = Path(mx.__file__).resolve().parent
    nb_root = Path(nanobind.__file__).resolve().parent
    return target, [*command, *all_flags, f"-I{sysconfig.get_paths()['include']}",
                    f"-I{nb_root / 'include'}", f"-I{nb_root / 'ext' / 'robin_map' / 'include'}",
                    f"-I{mlx_root / 'include'}", str(extension.source),
                    str(nb_root / "src" / "nb_combined.cpp"), f"-L{mlx_root / 'lib'}", "-lmlx",
                    f"-Wl,-rpath,{mlx_root / 'lib'}"]


def library(extension: Extension) -> Path:
    """``extension``'s built module, compiled on first use (with every other extension of
    :data:`MODULES` this process wants that is not built yet, concurrently). Raises
    :class:`Unavailable` when ``extension`` cannot be built; a companion's failure is left for its
    own first use to report."""
    target, command = _plan(extension)
    if target.is_file():
        return target
    with paths.locked_directory(paths.home() / "cpu_ops"):
        if target.is_file():
            return target
        builds = [(extension, target, command)]
        for other_target, other, other_command in _companion_plans(extension):
            if not other_target.is_file() and other_target != target:
                builds.append((other, other_target, other_command))
        errors = _compile(builds)
    if extension in errors:
        raise errors[extension]
    return target


def _compile(builds: list[tuple[Extension, Path, list[str]]]) -> dict[Extension, Unavailable]:
    """Run the compilers side by side, all within ``BUILD_TIMEOUT_S``; each module appears under
    its name only when complete. Returns the failures. On any exception (Ctrl-C included) every
    compiler still running is killed with its child stages and its temporary file removed."""
    errors: dict[Extension, Unavailable] = {}
    running: list[tuple[Extension, Path, str, subprocess.Popen]] = []
    try:
        for extension, target, command in builds:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=target.suffix, dir=target.parent)
                os.close(fd)
            except OSError as e:
                errors[extension] = Unavailable(f"cannot write {target.parent} ({e.strerror}); "
                                                "set MLXSPEC_HOME to a writable directory")
                continue
            try:
                process = subprocess.Popen([*command, "-o", tmp], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.PIPE, text=True,
                                           start_new_session=True)
            except OSError as e:
                os.unlink(tmp)
                errors[extension] = Unavailable(f"no working C++ compiler ({e}); install g++ or "
                                                "set CXX")
                continue
            running.append((extension, target, tmp, process))
        if running and sys.stderr.isatty():  # a person waiting; scripts get nothing new
            print("mlxspec: building its CPU ops (once, ~15 s)", file=sys.stderr, flush=True)
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        for extension, target, tmp, process in running:
            try:
                _, stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(process)
                stderr = f"timed out after {BUILD_TIMEOUT_S} s"
            if process.returncode == 0:
                os.replace(tmp, target)
                continue
            lines = stderr.splitlines()
            first = ([line for line in lines if "error" in line] or lines or ["no output"])[0]
            errors[extension] = Unavailable(f"compiling {extension.source.name} failed: {first}")
    except BaseException:
        for *_, process in running:
            if process.returncode is None:
                _kill(process)
        raise
    finally:
        for *_, tmp, _ in running:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return errors


def _kill(process: subprocess.Popen) -> None:
    """End a compiler and its stages (cc1plus, as, ld share its session), without reading the
    pipe they may still hold."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def load(path: Path, module_name: str) -> ModuleType:
    """Import the built module at ``path``."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise Unavailable(f"loading {path.name} failed ({e})") from e
    return module
