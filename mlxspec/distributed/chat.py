"""``mlxspec chat --shard``: rank 0 reads the user's lines; every change of the conversation is
sent to the other ranks (:mod:`mlxspec.distributed.follow`) before rank 0 makes it, and they make
the same change to their own :class:`~mlxspec.chat.ChatSession`: the same tokens, the same
forward passes, the same KV caches on every rank. While rank 0 waits for the user's next line
it ticks (:class:`~mlxspec.distributed.follow.Ticker`), so the followers sleep.

Messages (``op``): ``reply`` (``text``: the user's turn; the followers generate the same reply
and drop it), ``reset``, ``system`` (``text``: the new system prompt or None). The end of the
conversation is :data:`~mlxspec.distributed.follow.END`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from mlxspec.chat import ChatSession
from mlxspec.distributed.follow import END, MESSAGE, Ticker, receive_action, send
from mlxspec.distributed.group import waiting_for_input
from mlxspec.errors import MlxspecError
from mlxspec.generate import Response


class LeadingChat(ChatSession):
    """A :class:`ChatSession` on rank 0 of a sharded chat: each change goes to the followers
    first. A reply must then run to its end (the followers generate all of it): stopping one
    early would leave the ranks at different steps. :meth:`end` ends the followers."""

    def __init__(self, *args: Any, group: mx.distributed.Group | None = None, **kwargs: Any):
        self.group = group or mx.distributed.init()
        self.ticker = Ticker(self.group)
        super().__init__(*args, **kwargs)

    def _send(self, message: dict[str, Any]) -> None:
        self.ticker.busy()
        send(MESSAGE, message, self.group)

    def reset(self) -> None:
        self._send({"op": "reset"})
        super().reset()
        self.ticker.idle()

    def set_system(self, system: str | None) -> None:
        self._send({"op": "system", "text": system})
        super().set_system(system)
        self.ticker.idle()

    def stream_reply(self, user_text: str, **overrides: Any) -> Iterator[Response]:
        self._send({"op": "reply", "text": user_text, "overrides": overrides})
        reply = super().stream_reply(user_text, **overrides)
        try:
            yield from reply
        finally:
            reply.close()  # records the reply, as ChatSession's callers expect
            self.ticker.idle()

    def end(self) -> None:
        """End the conversation on every rank (the followers' :func:`follow_chat` returns)."""
        self.ticker.stop()
        send(END, None, self.group)


def follow_chat(session: ChatSession, group: mx.distributed.Group | None = None) -> None:
    """On a follower: make rank 0's changes to ``session`` until rank 0 ends the conversation.
    A turn rank 0 refused (an :class:`MlxspecError`, reported there) is refused here alike."""
    group = group or mx.distributed.init()
    while True:
        with waiting_for_input(session.model):  # rank 0 waits for the user meanwhile
            code, message = receive_action(group)
        if code == END:
            return
        op = message["op"]
        if op == "reply":
            try:
                for _ in session.stream_reply(message["text"], **message["overrides"]):
                    pass
            except MlxspecError:
                pass
        elif op == "reset":
            session.reset()
        elif op == "system":
            session.set_system(message["text"])
        else:
            raise ValueError(f"unknown chat message {op!r} from rank 0")
