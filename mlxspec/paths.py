"""Where mlxspec keeps its files."""

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def home() -> Path:
    """mlxspec's cache directory: ``$MLXSPEC_HOME``, default ``~/.cache/mlxspec``."""
    return Path(os.environ.get("MLXSPEC_HOME") or Path.home() / ".cache" / "mlxspec")


@contextlib.contextmanager
def locked_directory(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (created if missing) while the block runs, so that
    processes filling the same cache entry at once take turns: the second finds the first's
    result instead of redoing it or replacing it under a reader. No lock file is left behind (the
    directory itself is locked). A directory that cannot be created or opened is not locked: the
    work that follows reports why it cannot write there."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (closing releases the lock)
