"""The one thread of ``mlxspec serve`` that owns MLX: it admits ``Ticket`` objects (a parsed
request and the queue its events go to) into the ``Engine`` and steps it; the HTTP threads only
hand tickets over and read events back."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import mlx.core as mx

from mlxspec.engine import Engine
from mlxspec.openai_api import ApiError, Completion

log = logging.getLogger("mlxspec.serve")
POLL_SECONDS = 0.05  # how often a waiting connection (or the idle engine) checks again


@dataclass
class Ticket:
    """A request on its way through the engine thread; events arrive on ``events``."""

    completion: Completion
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: bool = False
    rid: int | None = None


class EngineThread(threading.Thread):
    """Owns the ``Engine``: admits tickets between steps, steps, and routes events."""

    def __init__(self, engine: Engine):
        super().__init__(name="mlxspec-engine", daemon=True)
        self.engine = engine
        self.inbox: queue.Queue[Ticket] = queue.Queue()
        self.tickets: dict[int, Ticket] = {}
        self._halt = threading.Event()
        self.failed: str | None = None

    def submit(self, ticket: Ticket) -> None:
        self.inbox.put(ticket)

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        while not self._halt.is_set():
            self._admit(block=not self.engine.streams)
            for rid in [rid for rid, t in self.tickets.items() if t.cancelled]:
                self.engine.cancel(rid)
                del self.tickets[rid]
            if not self.engine.streams:
                continue
            try:
                events = self.engine.step()
            except Exception as e:  # never leave clients hanging: fail the open requests
                log.exception("decode step failed")
                self._fail_all(f"generation failed: {e}")
                continue
            for event in events:
                ticket = self.tickets.get(event.rid)
                if ticket is not None:
                    ticket.events.put(event)
                    if event.finish_reason is not None:
                        del self.tickets[event.rid]
        self._fail_all("the server is shutting down")
        self.engine.close()
        mx.clear_streams()  # MLX's per-thread streams must go before the interpreter does

    def _admit(self, block: bool) -> None:
        try:
            ticket = self.inbox.get(timeout=POLL_SECONDS) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if not ticket.cancelled:
                try:
                    ticket.rid = self.engine.submit(ticket.completion.request)
                    self.tickets[ticket.rid] = ticket
                except ValueError as e:  # InvalidArgumentError included: the request's fault
                    ticket.events.put(ApiError(str(e)))
                except Exception as e:  # noqa: BLE001  one request must never stop the engine
                    ticket.events.put(ApiError(f"the request could not start: {e}", status=500,
                                               kind="server_error"))
            try:
                ticket = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _fail_all(self, message: str) -> None:
        for rid, ticket in list(self.tickets.items()):
            self.engine.cancel(rid)
            ticket.events.put(ApiError(message, status=500, kind="server_error"))
        self.tickets.clear()
        while not self.inbox.empty():
            self.inbox.get_nowait().events.put(ApiError(message, status=503, kind="server_error"))
