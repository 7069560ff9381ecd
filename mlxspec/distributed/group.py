"""The process group ``mlx.launch`` set up, and a watchdog for peers that stop answering."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np

from mlxspec import cpu
from mlxspec.errors import MlxspecError

# Seconds a rank waits for one forward pass (prefill chunk or decode step) before it gives up on
# its peers: the ring backend blocks forever on a peer that died without closing its socket.
DEFAULT_TIMEOUT_S = float(os.environ.get("MLXSPEC_SHARD_TIMEOUT", "60"))
BACKSTOP_S = 5.0  # after the timeout: the C thread's end, if the watchdog's thread did not run


class DistributedError(MlxspecError):
    """The process group cannot be set up, or a peer failed."""


def init_group() -> mx.distributed.Group:
    """The group of the ranks ``mlx.launch`` started (backend as it chose: ring, jaccl, mpi).

    Raises:
        DistributedError: this process was not started by a launcher (a group of one).
    """
    group = mx.distributed.init()
    if group.size() < 2:
        raise DistributedError(
            "--shard needs at least two processes: run it under "
            "`mlx.launch --backend ring -n 2 -- mlxspec generate --shard tensor ...`"
        )
    return group


def is_primary() -> bool:
    """True on rank 0 (or without a group): the rank that prints and serves."""
    return mx.distributed.init().rank() == 0


def group_report(group: mx.distributed.Group | None = None) -> dict[str, Any]:
    """The group as ``doctor`` and ``--json`` report it: backend, world size, this rank."""
    group = group or mx.distributed.init()
    backend = "ring" if os.environ.get("MLX_HOSTFILE") else (
        "jaccl" if os.environ.get("MLX_IBV_DEVICES") else (
            "mpi" if os.environ.get("OMPI_COMM_WORLD_SIZE") else "none"))
    return {"backend": backend if group.size() > 1 else "none", "world_size": group.size(),
            "rank": group.rank()}


def silence_followers() -> None:
    """Send the output of ranks other than 0 to /dev/null: rank 0 alone prints."""
    if not is_primary():
        devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        sys.stdout = devnull
        if not os.environ.get("MLXSPEC_SHARD_VERBOSE"):  # followers keep stderr to debug
            sys.stderr = devnull


class Watchdog:
    """Ends the process with one ``error:`` line (rank 0) and exit status 2 when no forward pass
    has started for ``timeout_s`` seconds: a peer died or hangs, and a collective would block.

    ``beat()`` is called at each forward pass; use as a context manager around generation.
    While the job waits for its input (rank 0 for a chat line or an HTTP request, the followers
    for rank 0's next message) the watchdog is paused: waiting for a user is no failure.
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._last = time.monotonic()
        self._paused = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._backstop = False  # the C deadline armed (mlxspec.cpu.deadline)
        self.backstop_s = BACKSTOP_S

    def beat(self) -> None:
        self._last = time.monotonic()
        if self._backstop:
            cpu.deadline(self.timeout_s + self.backstop_s)

    def pause(self) -> None:
        """Stop counting until :meth:`resume`: the job waits for input, not for a peer."""
        self._paused = True
        if self._backstop:
            cpu.deadline(0)

    def resume(self) -> None:
        self._paused = False
        self.beat()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.timeout_s / 4)):
            if not self._paused and time.monotonic() - self._last > self.timeout_s:
                if is_primary():
                    sys.__stderr__.write(f"error: {self._message()}\n")
                    sys.__stderr__.flush()
                os._exit(2)

    def __enter__(self) -> Watchdog:
        # The same end from a C thread backstop_s later, for when this thread cannot run: the
        # Python thread stuck in a call that holds the GIL (seen once in the suite, under load).
        message = f"error: {self._message()}\n" if is_primary() else ""
        self._backstop = cpu.deadline(self.timeout_s + self.backstop_s, message)
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._backstop:
            cpu.deadline(0)

    def _message(self) -> str:
        return (f"a rank of the group stopped answering for {self.timeout_s:.0f} s (it failed "
                "or its host went away); check the other ranks' hosts and rerun "
                "(MLXSPEC_SHARD_TIMEOUT sets the wait)")


def waiting_for_input(model: Any) -> contextlib.AbstractContextManager:
    """Around a wait for input (a chat line, a request, rank 0's next message): pauses the
    watchdog of a model :func:`~mlxspec.distributed.load_sharded` gave (nothing otherwise)."""
    watchdog = getattr(model, "watchdog", None)
    return watchdog.paused() if watchdog is not None else contextlib.nullcontext()


def agreed_decoding(num_draft_tokens: int | str, seed: int | None,
                    group: mx.distributed.Group | None = None) -> tuple[int | str, int]:
    """``(num_draft_tokens, seed)`` every rank of a sharded run decodes with: the draft length
    as given (an int, or ``"auto"``: rank 0 chooses each pass's, :mod:`.drafting`), and rank
    0's seed (a random one when none was given), so that every sampled token and every
    rejection-sampling draw is the same on every rank (mlxspec draws the token at each position
    with a key from the seed)."""
    group = group or mx.distributed.init()
    k = "auto" if num_draft_tokens == "auto" else int(num_draft_tokens)
    mine = seed if seed is not None else int.from_bytes(os.urandom(3), "little")
    # rank 0's value reaches every rank: the others add zeros (exact in float32 below 2**24)
    shared = mx.distributed.all_sum(mx.array(float(mine) if group.rank() == 0 else 0.0),
                                    group=group)
    return k, int(shared.item())


def ordered_all_sum(values: np.ndarray, group: mx.distributed.Group | None = None) -> np.ndarray:
    """The int32 all-sum of ``values`` over the group (default: the global one), evaluated on
    mlx-lm's generation stream, behind the forward passes already queued there: every rank's
    collectives then pair in program order (on another stream a sum could pair with a peer's
    in-flight stage sum instead, and both ranks would wait forever)."""
    from mlx_lm.generate import generation_stream

    with mx.stream(generation_stream):
        total = mx.distributed.all_sum(mx.array(values, dtype=mx.int32),
                                       group=group or mx.distributed.init())
        mx.eval(total)
    return np.array(total, dtype=np.int32)


def barrier(group: mx.distributed.Group | None = None) -> None:
    """Wait for every rank: a rank that exits while a peer still has a collective in flight
    (the decode loop evaluates one step ahead) would cut that peer's connection. Ordered behind
    that step's collectives (:func:`ordered_all_sum`; unordered, the end of a pipeline run hung
    once under load)."""
    ordered_all_sum(np.ones(1, np.int32), group)


def lost_peer(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because a peer went away (MLX raises a
    ``RuntimeError`` naming its backend)."""
    return isinstance(e, RuntimeError) and ("[ring]" in str(e) or "distributed" in str(e).lower())


def peer_lost_error(e: RuntimeError) -> DistributedError:
    """The one-line error of a run whose peer went away (``e``: the collective's error)."""
    return DistributedError(f"a rank of the group failed or went away ({str(e).strip()}); check "
                            "the other ranks' output and hosts and rerun")


@contextlib.contextmanager
def sharded_run(mode: str | None) -> Iterator[None]:
    """Around a command run with ``--shard mode`` (nothing without): a lost peer becomes one
    :class:`DistributedError`, and on success every rank waits for the others before exiting."""
    if mode is None:
        yield
        return
    try:
        yield
    except SystemExit:  # a refused input (a chat line): the others finished the run alike
        barrier()
        raise
    except RuntimeError as e:
        if lost_peer(e):
            raise peer_lost_error(e) from e
        raise
    barrier()
