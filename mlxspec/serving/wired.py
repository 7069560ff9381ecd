"""MLX's wired-memory limit, shared by every engine in the process (Metal only; a no-op on a CPU).

The limit is process-wide. An engine that set it on start and put back "its" previous value on
close would, with two engines closing in the order they opened, restore the limit of the wrong
one: the first to close would take the second's limit away while it still ran, the second would
then leave the recommended limit set for good. Here the first holder sets it and the last one
restores the value from before the first: any order of closing is right.
"""

from __future__ import annotations

import threading

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.utils import maybe_set_recommended_wired_limit

_lock = threading.Lock()
_holders = 0
_before: int | None = None  # the limit before the first holder set it (None: nothing set)


def hold() -> None:
    """An engine starts: the recommended wired limit is set if no engine holds it yet."""
    global _holders, _before
    with _lock:
        if _holders == 0:
            _before = maybe_set_recommended_wired_limit()
        _holders += 1


def release() -> None:
    """An engine closes: the last holder restores the limit from before the first."""
    global _holders, _before
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _before is not None:
            mx.synchronize(generation_stream)  # no running kernel loses its wired memory
            mx.set_wired_limit(_before)
            _before = None


def holders() -> int:
    """How many engines hold the limit now (for tests and reports)."""
    return _holders
