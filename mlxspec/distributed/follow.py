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
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

# Codes of the header: what the message is.
END = 0  # the leader is done: followers return
MESSAGE = 1  # a JSON payload follows
STEP = 2  # the engine steps (no payload)
STEP_SOLO = 3  # the engine steps, its lone stream moving to speculative decoding


def _all_sum(values: np.ndarray, group: mx.distributed.Group) -> np.ndarray:
    with mx.stream(generation_stream):
        total = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=group)
        mx.eval(total)
    return np.array(total, dtype=np.int32)


def send(code: int, message: dict[str, Any] | None = None,
         group: mx.distributed.Group | None = None) -> None:
    """On rank 0: send ``code`` and ``message`` (a JSON-serializable dict, or None) to every rank.

    Blocks until every follower has called :func:`receive` for it.
    """
    group = group or mx.distributed.init()
    data = json.dumps(message, ensure_ascii=False).encode() if message is not None else b""
    _all_sum(np.array([len(data), code], np.int32), group)
    if data:
        words = np.frombuffer(data + b"\0" * (-len(data) % 4), dtype="<i4")
        _all_sum(words, group)


def receive(group: mx.distributed.Group | None = None) -> tuple[int, dict[str, Any] | None]:
    """On a follower: the next ``(code, message)`` rank 0 sends (blocks until it does)."""
    group = group or mx.distributed.init()
    nbytes, code = (int(v) for v in _all_sum(np.zeros(2, np.int32), group))
    if nbytes == 0:
        return code, None
    words = _all_sum(np.zeros((nbytes + 3) // 4, np.int32), group)
    return code, json.loads(words.astype("<i4").tobytes()[:nbytes].decode())
