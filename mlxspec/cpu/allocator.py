"""Linux: the ``mlxspec`` command runs on mimalloc instead of glibc's malloc.

MLX's CPU backend takes every array of a step (activations, logits, cache updates) from
``malloc`` and frees it when the graph is done, often on another thread than the one that took
it. glibc serves those from per-thread arenas behind a lock, maps the large ones afresh each time
and hands their pages back, so a decode step pays for locks, page faults and zeroing that have
nothing to do with the model. mimalloc keeps freed memory per thread, frees across threads
without a lock and backs its arenas with 2 MB pages. Measured on SmolLM2 (bench/allocator.py,
bench/results/allocator.json), engine decode steps: 1 stream 32.0 -> 27.1 ms, 8 streams 44.0 ->
37.4 ms. The arithmetic and the order of every operation are the same, so every output is bitwise
the same.

The allocator of a process can only be chosen when it starts (``LD_PRELOAD``), so the command
executes itself again once, with mimalloc preloaded (PyTorch's and Intel's CPU launchers do the
same for jemalloc and tcmalloc). ``mlxspec/__init__.py`` does it first thing, before the BLAS
set-up and before MLX is imported, and only when the process is the ``mlxspec`` command (its
console script, or ``python -m mlxspec.cli.main``): a program that imports mlxspec, or calls
the command's ``main()``, is never replaced. In the new process ``LD_PRELOAD`` is put back as the
user had it, so the programs mlxspec starts are not affected.

- ``MLXSPEC_MIMALLOC=0`` keeps glibc's allocator; an allocator the user preloads (jemalloc,
  tcmalloc, mimalloc) is kept.
- Nothing happens off Linux (Metal buffers do not come from ``malloc``) or when the
  ``cmeel-mimalloc`` wheel is missing; ``mlxspec doctor`` says which allocator runs.
- A script that imports mlxspec keeps the allocator it was started with; to run one on mimalloc:
  ``LD_PRELOAD=$(python -m mlxspec.cpu.allocator) python script.py``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

from mlxspec.switches import turned_off

SWITCH = "MLXSPEC_MIMALLOC"
# Set for the one re-execution: the user's own LD_PRELOAD (possibly empty), to be put back.
USER_PRELOAD = "_MLXSPEC_USER_LD_PRELOAD"
LIBRARY = "libmimalloc.so.3"


def library_path() -> Path | None:
    """The mimalloc shared library installed by the ``cmeel-mimalloc`` wheel, if any."""
    if not sys.platform.startswith("linux"):
        return None
    from importlib import metadata

    try:
        files = metadata.files("cmeel-mimalloc") or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == LIBRARY:
            path = Path(file.locate()).resolve()
            return path if path.is_file() else None
    return None


def launched_as_command() -> bool:
    """Whether this process is the ``mlxspec`` command: its console script (``sys.argv[0]`` is
    the script while the package is imported) or ``python -m mlxspec.cli.main``."""
    if not sys.argv:
        return False
    if Path(sys.argv[0]).name == "mlxspec":
        return True
    argv = list(getattr(sys, "orig_argv", []))
    return sys.argv[0] == "-m" and "-m" in argv and argv[argv.index("-m") + 1:][:1] == [
        "mlxspec.cli.main"]


def _user_allocator(preload: str) -> bool:
    """Whether an ``LD_PRELOAD`` value preloads an allocator (jemalloc, tcmalloc, mimalloc)."""
    return "malloc" in preload


def in_use() -> bool:
    """Whether mimalloc is mapped into this process (so it serves ``malloc``: it can only get
    here preloaded, as nothing else in mlxspec loads it)."""
    try:
        return "libmimalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def reexec_environment(environ: MutableMapping[str, str]) -> dict[str, str] | None:
    """The environment to execute the command again with, or None to go on as it is.

    In the re-executed process (``USER_PRELOAD`` set), puts the user's ``LD_PRELOAD`` back into
    ``environ`` and returns None, so there is never a second re-execution.
    """
    if USER_PRELOAD in environ:
        user_preload = environ.pop(USER_PRELOAD)
        if user_preload:
            environ["LD_PRELOAD"] = user_preload
        else:
            environ.pop("LD_PRELOAD", None)
        return None
    user_preload = environ.get("LD_PRELOAD", "")
    if turned_off(SWITCH, environ) or in_use() or _user_allocator(user_preload):
        return None  # switched off, already on mimalloc, or the user's own allocator stays
    library = library_path()
    if library is None or any(c in str(library) for c in " :"):  # LD_PRELOAD splits at those
        return None
    return {**environ, USER_PRELOAD: user_preload,
            "LD_PRELOAD": f"{library}:{user_preload}" if user_preload else str(library)}


def reexec_on_mimalloc() -> None:
    """Replace this process by the same command on mimalloc, when that applies (see the module
    docstring). Only for the ``mlxspec`` command (``launched_as_command``), before anything has
    run: the process starts over from its command line."""
    environment = reexec_environment(os.environ)
    if environment is None or not sys.executable or not getattr(sys, "orig_argv", None):
        return
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, environment)
    except (OSError, ValueError):  # cannot execute the interpreter again: go on with glibc's
        return


def describe() -> str:
    """One line for ``mlxspec doctor``."""
    if in_use():
        return "mimalloc (the mlxspec command preloads it; MLXSPEC_MIMALLOC=0 keeps glibc's)"
    if not sys.platform.startswith("linux"):
        return "the system's"
    if turned_off(SWITCH):
        return f"glibc's ({SWITCH}=0)"
    if _user_allocator(os.environ.get("LD_PRELOAD", "")):
        return "the one preloaded by the user (LD_PRELOAD)"
    if library_path() is None:
        return "glibc's (cmeel-mimalloc is not installed; pip install cmeel-mimalloc)"
    return ("glibc's: only the mlxspec command runs on mimalloc; for a script: "
            "LD_PRELOAD=$(python -m mlxspec.cpu.allocator) python script.py")


if __name__ == "__main__":
    path = library_path()
    if path is None:
        sys.exit("error: no mimalloc library: pip install cmeel-mimalloc (Linux only)")
    print(path)
