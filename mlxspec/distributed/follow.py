"""The shared-input protocol of a sharded ``chat``, ``serve`` and ``batch``: rank 0 (the leader)
reads the input; before every action that runs forward passes it sends that action to the other
ranks (the followers), which then run the same action, so every rank runs the same passes.

A message is a small JSON object (``{"op": "reply", "text": ...}``,
``{"op": "submit", "request": {...}}``, ...) or a bare code (the per-step messages of the engine,
:mod:`mlxspec.distributed.mirror`). On the wire it is two all-sums to which only rank 0
contributes (the followers add zeros, so the sums are exact in int32):

- the header, shape ``(2,)`` int32: ``[payload bytes, code]``;
- the payload, shape ``(ceil(bytes / 4),)`` int32: the UTF-8 JSON, zero-padded to whole words and
  read as little-endian int32; left out when the header says 0 bytes.

Both run on ``generation_stream`` (one per thread in mlx-lm), after the forward passes the caller
already queued there: each rank's collectives then pair in program order, which mirroring makes
the same on every rank (collectives on two streams could pair one rank's message with another
rank's layer all-reduce).

A follower waiting inside a collective spins (MLX's ring backend polls its sockets: a whole
core). So while rank 0 waits for input, a :class:`Ticker` sends ``TICK`` every ``IDLE_TICK_S``,
and a follower sleeps as long after each tick before it waits again (bench/distributed.py
measures both: ``idle_serve``). Its cost: a message arriving during a follower's sleep
waits for it (at most ``IDLE_TICK_S``). ``MLXSPEC_SHARD_IDLE_TICK`` sets the tick in seconds
(0: no ticks, followers spin).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from mlxspec.distributed.group import ordered_all_sum

# Codes of the header: what the message is.
END = 0  # the leader is done: followers return
MESSAGE = 1  # a JSON payload follows
STEP = 2  # the engine steps (no payload)
STEP_SOLO = 3  # the engine steps, its lone stream moving to speculative decoding
TICK = 4  # rank 0 still waits for input (no payload): sleep, then wait again
IDLE_TICK_S = float(os.environ.get("MLXSPEC_SHARD_IDLE_TICK", "0.05"))


def send(code: int, message: dict[str, Any] | None = None,
         group: mx.distributed.Group | None = None) -> None:
    """On rank 0: send ``code`` and ``message`` (a JSON-serializable dict, or None) to every rank.

    Blocks until every follower has called :func:`receive` for it.
    """
    group = group or mx.distributed.init()
    data = json.dumps(message, ensure_ascii=False).encode() if message is not None else b""
    ordered_all_sum(np.array([len(data), code], np.int32), group)
    if data:
        words = np.frombuffer(data + b"\0" * (-len(data) % 4), dtype="<i4")
        ordered_all_sum(words, group)


def receive(group: mx.distributed.Group | None = None) -> tuple[int, dict[str, Any] | None]:
    """On a follower: the next ``(code, message)`` rank 0 sends (blocks until it does)."""
    group = group or mx.distributed.init()
    nbytes, code = (int(v) for v in ordered_all_sum(np.zeros(2, np.int32), group))
    if nbytes == 0:
        return code, None
    words = ordered_all_sum(np.zeros((nbytes + 3) // 4, np.int32), group)
    return code, json.loads(words.astype("<i4").tobytes()[:nbytes].decode())


def receive_action(group: mx.distributed.Group | None = None) -> tuple[int, dict[str, Any] | None]:
    """On a follower: the next ``(code, message)`` that is not a ``TICK`` (after each tick it
    sleeps ``IDLE_TICK_S``, as rank 0's ticker does, instead of spinning in the collective)."""
    while True:
        code, message = receive(group)
        if code != TICK:
            return code, message
        time.sleep(IDLE_TICK_S)


class Ticker:
    """On rank 0: a thread that sends ``TICK`` every ``IDLE_TICK_S`` while rank 0 waits for
    input (between :meth:`idle` and :meth:`busy`), so that the followers sleep instead of
    spinning in a collective. Every other message must be sent between :meth:`busy` and the
    next :meth:`idle` (never two sends at once); :meth:`stop` ends the thread."""

    def __init__(self, group: mx.distributed.Group | None = None) -> None:
        self.group = group or mx.distributed.init()
        self._idle, self._stopped = threading.Event(), False
        self._lock = threading.Lock()  # held while a tick is sent
        self._thread = threading.Thread(target=self._run, name="mlxspec-ticks", daemon=True)
        self._thread.start()

    def idle(self) -> None:
        """Rank 0 waits for input from now on. The caller's forward passes finish first: the
        ticks run on another thread's stream, which nothing orders after them."""
        mx.synchronize(generation_stream)
        if IDLE_TICK_S > 0:
            self._idle.set()

    def busy(self) -> None:
        """Rank 0 sends a message next: stop ticking (after the tick under way, if any)."""
        self._idle.clear()
        with self._lock:
            pass

    def stop(self) -> None:
        self.busy()
        self._stopped = True
        self._idle.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            while self._idle.wait() and not self._stopped:
                time.sleep(IDLE_TICK_S)
                with self._lock:
                    if self._idle.is_set() and not self._stopped:
                        send(TICK, None, self.group)
        except RuntimeError:
            pass  # a lost peer: rank 0's next message reports it
        finally:
            mx.clear_streams()  # this thread's MLX streams go with it, not at interpreter exit
