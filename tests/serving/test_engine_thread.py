"""`mlxspec.serving.engine_thread`: after a step that finished a request, the engine thread waits a
fraction of a step (``RETURN_WAIT``) for the client's next request, which then joins the very next
step instead of the one after it.

The engine here is a stand-in that records the order of the thread's calls: what is tested is
the thread's scheduling, in time, which a real model's step times would make flaky."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from mlxspec.serving import engine_thread
from mlxspec.serving.engine_thread import EngineThread, Ticket
from mlxspec.serving.requests import Event

STEP_SECONDS = 0.2  # the stand-in's decode step: RETURN_WAIT (0.3) of it is 60 ms
CLIENT_SECONDS = 0.02  # a returning client's round trip: inside that window, after step 5 starts


class RecordingEngine:
    """Two streams; the first finishes at its fourth step. Records ("submit", rid) and
    ("step", n) in order."""

    def __init__(self) -> None:
        self.streams: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.steps = 0

    def submit(self, request) -> int:
        rid = len([c for c in self.calls if c[0] == "submit"])
        self.streams[rid] = 0
        self.calls.append(("submit", rid))
        return rid

    def step(self) -> list[Event]:
        self.steps += 1
        self.calls.append(("step", self.steps))
        time.sleep(STEP_SECONDS)
        events = []
        for rid in list(self.streams):
            self.streams[rid] += 1
            done = rid == 0 and self.streams[rid] == 4
            events.append(Event(rid=rid, text="x", token=1, finish_reason="length" if done else None))
            if done:
                del self.streams[rid]
        return events

    def cancel(self, rid: int) -> None:
        self.streams.pop(rid, None)

    def close(self) -> None:
        pass


def _ticket() -> Ticket:
    return Ticket(SimpleNamespace(request=None))


def _run(monkeypatch, wait: float) -> list[tuple[str, int]]:
    """The calls when the first request's client sends its next one ``CLIENT_SECONDS`` after
    its answer ends."""
    monkeypatch.setattr(engine_thread, "RETURN_WAIT", wait)
    engine = RecordingEngine()
    thread = EngineThread(engine)
    first, second = _ticket(), _ticket()
    thread.submit(first)
    thread.submit(second)
    thread.start()

    def client() -> None:
        while True:
            event = first.events.get(timeout=5)
            if event.finish_reason is not None:
                break
        time.sleep(CLIENT_SECONDS)
        thread.submit(_ticket())

    returning = threading.Thread(target=client)
    returning.start()
    returning.join(timeout=5)
    deadline = time.monotonic() + 5
    while ("submit", 2) not in engine.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    thread.stop()
    thread.join(timeout=5)
    return engine.calls


@pytest.mark.parametrize("wait", [engine_thread.RETURN_WAIT, 0.0], ids=["waits", "no-wait"])
def test_a_returning_client_joins_the_next_step(monkeypatch, wait):
    calls = _run(monkeypatch, wait)
    joined = calls.index(("submit", 2))
    after = [n for kind, n in calls[joined:] if kind == "step"]
    # Step 4 finished the first request; waiting, its client's next request is admitted before
    # step 5 is built; not waiting, step 5 is already under way when it comes.
    assert after and after[0] == (5 if wait else 6)
