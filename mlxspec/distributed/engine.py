"""``mlxspec serve --shard`` and ``mlxspec batch --shard``: the continuous-batching
:class:`~mlxspec.serving.engine.Engine` mirrored on every rank.

Rank 0 runs the server or the batch job with a :class:`LeadingEngine`: before each call that
changes the engine (open, ``share_prefix``, ``submit``, ``cancel``, ``step``, ``close``) it sends
the call to the other ranks (:mod:`mlxspec.distributed.follow`), which make it on their own
engine (:func:`follow_engine`). Every rank then has the same streams and runs the same forward
passes, batched or speculative. The one decision an engine takes from its own timings, whether
a lone stream decodes speculatively, is rank 0's and travels in each step's header; that
stream's draft lengths are rank 0's too (its loop's decisions, :mod:`.drafting`). Requests
sample from MLX's generator seeded alike on every rank before the first request.

Messages (``op``): ``open`` (``options``: the engine's keyword arguments but the drafter;
``draft``: whether it has one; ``seed``), ``share_prefix`` (``tokens``), ``submit``
(``request``: the :class:`~mlxspec.serving.requests.Request`'s fields), ``cancel`` (``rid``),
``close`` (the end of the job); a step is the bare code ``STEP`` or ``STEP_SOLO``. While no
stream is open rank 0 ticks (:class:`~mlxspec.distributed.follow.Ticker`): the followers sleep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any, NoReturn

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream

from mlxspec.distributed.follow import (
    END,
    MESSAGE,
    STEP,
    STEP_SOLO,
    Ticker,
    receive_action,
    send,
)
from mlxspec.distributed.group import lost_peer, peer_lost_error, waiting_for_input
from mlxspec.serving.engine import Engine
from mlxspec.serving.requests import Event, Request

# Streams a sharded batch job decodes together unless --batch-size says: the measured choice
# (``choose_batch_size``) times each rank's own passes, so the ranks could choose differently.
SHARDED_BATCH_SIZE = 8


class _Mirrored(Engine):
    """An engine whose speculation decision is made for it (``solo``), seeded before the first
    request with ``seed`` in the thread that runs it (MLX's generator is per thread)."""

    def __init__(self, *args: Any, seed: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.seed, self.solo, self._seeded = seed, False, False

    def _wants_solo(self) -> bool:
        return self.solo

    def _seed_once(self) -> None:
        if not self._seeded:
            mx.random.seed(self.seed)
            self._seeded = True

    def close(self) -> None:
        super().close()
        mx.synchronize(generation_stream)  # no forward pass in flight behind the next message


class LeadingEngine(_Mirrored):
    """The engine on rank 0: every call that changes it is sent to the followers first.

    Args: as :class:`Engine`, plus ``seed`` (every rank's, from ``agreed_decoding``).
    """

    def __init__(self, model: nn.Module, tokenizer: Any, *, seed: int,
                 group: mx.distributed.Group | None = None, **options: Any):
        self.group = group or mx.distributed.init()
        self.ticker = Ticker(self.group)
        shared = {k: v for k, v in options.items() if k != "draft"}
        self._send(MESSAGE, {"op": "open", "options": shared, "seed": seed,
                             "draft": options.get("draft") is not None})
        super().__init__(model, tokenizer, seed=seed, **options)
        self.watchdog = getattr(model, "watchdog", None)
        self._idle()

    def _send(self, code: int, message: dict[str, Any] | None = None) -> None:
        self.ticker.busy()
        try:
            send(code, message, self.group)
        except RuntimeError as e:
            if lost_peer(e):
                _end_job(e)
            raise

    def _idle(self) -> None:
        """While no stream is open (the job waits for requests): tick, and pause the watchdog."""
        if not self.streams:
            if self.watchdog is not None:
                self.watchdog.pause()
            self.ticker.idle()

    def share_prefix(self, tokens: list[int]) -> None:
        self._send(MESSAGE, {"op": "share_prefix", "tokens": list(tokens)})
        super().share_prefix(tokens)
        self._idle()

    def submit(self, request: Request) -> int:
        self._send(MESSAGE, {"op": "submit", "request": dataclasses.asdict(request)})
        if self.watchdog is not None:
            self.watchdog.resume()
        self._seed_once()
        try:
            return super().submit(request)
        finally:
            self._idle()

    def cancel(self, rid: int) -> None:
        self._send(MESSAGE, {"op": "cancel", "rid": rid})
        super().cancel(rid)
        self._idle()

    def step(self) -> list[Event]:
        # The decision Engine.step would take from this rank's timings, taken once for all.
        self.solo = self._solo is None and Engine._wants_solo(self)
        self._send(STEP_SOLO if self.solo else STEP)
        try:
            events = super().step()
        except RuntimeError as e:  # a lost rank: the server must not go on without it
            if lost_peer(e):
                _end_job(e)
            raise
        self._idle()
        return events

    def close(self) -> None:
        """Close the engine on every rank: the followers' :func:`follow_engine` returns."""
        self._send(MESSAGE, {"op": "close"})
        self.ticker.stop()
        super().close()


def _end_job(e: RuntimeError) -> NoReturn:
    """A sharded job whose engine call failed (a rank went away) ends: one ``error:`` line, exit
    status 2 (a server's engine thread would otherwise fail each request and serve on)."""
    sys.stdout.flush()
    sys.__stderr__.write(f"error: {peer_lost_error(e)}\n")
    sys.__stderr__.flush()
    os._exit(2)


def _request(fields: dict[str, Any]) -> Request:
    """The :class:`Request` of a ``submit`` message (JSON made the logit bias keys strings)."""
    bias = fields.get("logit_bias")
    if bias is not None:
        fields["logit_bias"] = {int(k): v for k, v in bias.items()}
    fields["stop"] = tuple(fields.get("stop") or ())
    return Request(**fields)


def follow_engine(model: nn.Module, tokenizer: Any, draft: Any = None,
                  group: mx.distributed.Group | None = None) -> None:
    """On a follower: make rank 0's engine calls on an engine of its own until rank 0 closes
    it (or sends ``END`` before opening one).

    ``draft``: this rank's drafter, built from the same options as rank 0's. A call rank 0's
    engine refused (a request's ``ValueError``) is refused here alike and skipped.
    """
    group = group or mx.distributed.init()
    engine: _Mirrored | None = None
    while True:
        idle = engine is None or not engine.streams
        with waiting_for_input(model) if idle else contextlib.nullcontext():
            code, message = receive_action(group)
        if code == END:
            return
        if code in (STEP, STEP_SOLO):
            engine.solo = code == STEP_SOLO
            try:
                engine.step()
            except Exception as e:  # noqa: BLE001  rank 0's step failed alike; its caller goes on
                if lost_peer(e):
                    raise
            continue
        op = message["op"]
        if op == "open":
            engine = _Mirrored(model, tokenizer, seed=message["seed"],
                               draft=draft if message["draft"] else None, **message["options"])
        elif op == "share_prefix":
            engine.share_prefix(message["tokens"])
        elif op == "submit":
            engine._seed_once()
            try:
                engine.submit(_request(message["request"]))
            except ValueError:
                pass
        elif op == "cancel":
            engine.cancel(message["rid"])
        elif op == "close":  # the end of the job
            engine.close()
            return
        else:
            raise ValueError(f"unknown engine message {op!r} from rank 0")

