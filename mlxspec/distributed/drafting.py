"""Speculation with a sharded target, drafted on rank 0 alone: rank 0 builds and runs the
drafter (a draft model, prompt lookup, a feature draft) and its planner, and before every pass
its decision reaches the other ranks in one all-sum: the drafts to verify, or the number of plain
steps to run. Every rank then runs the same sharded passes; the accepted tokens follow from the
verification, which each rank computes alike, so every rank's caches stay the same without
another message.

The message is one int32 vector of ``most + 3`` words, ``[k, stretch, n, d1..dn, 0...]`` (``most``
bounds every rank's k alike), to which only rank 0 contributes (the others add zeros, so the sum
is exact), sent as :mod:`follow`'s messages are: on the stream of the forward passes, so it pairs
with the same collective on every rank. Draft lengths are rank 0's auto-k choices, from its own
timings (which include the ranks' rounds). A plain stretch runs whole on every rank: one process
ends a stretch early when prompt lookup finds a match (or the other drafter of a pair is ready),
checked after each token; across ranks that check would cost a message a token, so such a
stretch is cut to :data:`LOOKOUT` steps and the check comes with the next decision.

The other ranks hold a :class:`FollowerDrafter` instead of the drafter (no draft model loaded,
no head): :func:`drafter_on_rank_0` builds the drafter on rank 0 and sends the little the others
need, once. A feature draft reads the hidden states of the verifying pass: every rank runs the
same tapped forward (a pipeline's taps ride its stage sums, :mod:`.shard`), and only rank 0
keeps them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mlxspec.distributed.follow import MESSAGE, receive, send
from mlxspec.distributed.group import DistributedError, ordered_all_sum
from mlxspec.speculative.drafters import Draft, Drafter

# Plain steps a stretch that one process could end after any token (a lookup match, the other
# drafter's turn) runs before rank 0 decides again: each decision costs one round.
LOOKOUT = 4


class SharedDrafter(Drafter):
    """``inner`` on rank 0, whose decisions (``agree``) every rank of ``group`` runs; the others
    draft nothing.

    Only the proposed tokens travel, not the distributions they were drawn from: use it where
    verification does not read them (greedy decoding, or seeded sampling, as every sharded run
    samples: ``mlxspec.speculative.loop`` seeds an unseeded one from MLX's generator, seeded
    alike on every rank). Rank 0's context is the inner drafter's own; the followers' inner
    drafter (a :class:`FollowerDrafter`) is left untouched.
    """

    stops_early = False  # a stretch runs whole on every rank (see LOOKOUT)

    def __init__(self, inner: Drafter, group: mx.distributed.Group) -> None:
        # No Drafter.__init__: prefix, context and pass_costs are the inner drafter's.
        self.inner, self.group = inner, group
        self.leader = group.rank() == 0
        self.name = inner.name
        self.step_seconds, self.catch_up_seconds = inner.step_seconds, inner.catch_up_seconds
        self.pass_costs = inner.pass_costs

    @property
    def prefix(self) -> list[int]:  # type: ignore[override]
        return self.inner.prefix

    @property
    def context(self) -> list[int]:  # type: ignore[override]
        return self.inner.context

    def begin(self, context: Sequence[int]) -> None:
        if self.leader:
            self.inner.begin(context)

    def extend(self, tokens: Sequence[int]) -> None:
        if self.leader:
            self.inner.extend(tokens)

    def planner(self, num_draft_tokens: int | str, sampling: Any) -> Any:
        return self.inner.planner(num_draft_tokens, sampling)

    def propose(self, k: int, sampling: Any, logits_processor: Any = None,
                keys: Any = None) -> Draft:
        """Rank 0's own proposal (``agree`` shares it)."""
        return self.inner.propose(k, sampling, logits_processor, keys)

    def agree(self, k: int, stretch: int, watched: bool, most: int,
              propose: Callable[[], Draft]) -> tuple[int, int, Draft | None]:
        """Rank 0's ``(k, stretch, proposal)`` on every rank, in one message (the module's
        docstring); the arguments are read on rank 0 only, but ``most``, alike everywhere."""
        words, caught_up = np.zeros(most + 3, np.int32), 0
        if self.leader:
            k = min(k, most)
            tokens: list[int] = []
            if k:
                draft = propose()
                tokens, caught_up = draft.tokens[:k], draft.caught_up
            elif watched:
                stretch = min(stretch, LOOKOUT)
            words[:3] = k, stretch, len(tokens)
            words[3:3 + len(tokens)] = tokens
        tic = time.perf_counter()
        shared = ordered_all_sum(words, self.group)
        self.round_seconds = time.perf_counter() - tic
        k, stretch, n = (int(v) for v in shared[:3])
        if k == 0:
            return 0, stretch, None
        return k, 0, Draft(mx.array(shared[3:3 + n], mx.uint32), caught_up=caught_up)

    def can_propose(self) -> bool:
        return self.inner.can_propose() if self.leader else True

    def unseen(self) -> int:
        return self.inner.unseen() if self.leader else 0

    def unsupported_reason(self) -> str | None:
        return self.inner.unsupported_reason()

    def target_model(self, model: Any) -> Any:
        """Rank 0: the inner drafter's (a feature draft's tapped forward, which keeps the hidden
        states); the others: the same forward without keeping them (its collectives must pair
        with rank 0's), or ``model`` itself."""
        target = self.inner.target_model(model)
        taps = getattr(target, "taps", None)
        if self.leader or taps is None:
            return target
        return FollowerTarget(model, taps)

    def reset(self) -> None:
        self.inner.reset()


class FollowerTarget:
    """On a rank other than 0: the target as a feature draft's verifying pass runs it
    (``model.tapped_forward`` with the head's ``taps``), keeping no hidden state."""

    def __init__(self, model: Any, taps: Sequence[int]) -> None:
        self.model, self.taps = model, list(taps)

    def __getattr__(self, name: str) -> Any:  # layers, args, make_cache: the model's
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: list | None = None, **kwargs: Any) -> mx.array:
        return self.model.tapped_forward(inputs, cache, self.taps)[0]


class FollowerDrafter(Drafter):
    """What a rank other than 0 holds for rank 0's drafter: its name, whether it can run (rank
    0's ``unsupported_reason``) and, for a feature draft, the taps the verifying pass computes.
    It drafts nothing (:class:`SharedDrafter` hands it rank 0's proposals): no model, no head."""

    def __init__(self, name: str, reason: str | None, taps: Sequence[int] | None) -> None:
        super().__init__()
        self.name, self.reason = name, reason
        self.taps = None if taps is None else list(taps)

    def propose(self, k: int, sampling: Any, logits_processor: Any = None,
                keys: Any = None) -> Draft:
        raise RuntimeError("a follower drafted: a sharded target's speculation must go through "
                           "its share_drafter (mlxspec.speculative.loop)")

    def unsupported_reason(self) -> str | None:
        return self.reason

    def target_model(self, model: Any) -> Any:
        return model if self.taps is None else FollowerTarget(model, self.taps)


class Rank0Draft:
    """Stands, on the ranks other than 0, for the draft model they do not load: passed as
    ``draft_model`` where rank 0 passes the loaded one (:func:`drafter_on_rank_0` never reads it)."""


def drafter_on_rank_0(build: Callable[[], Drafter | None], model: Any,
                      group: mx.distributed.Group) -> Drafter | None:
    """``build()`` on rank 0, and a :class:`FollowerDrafter` of it on the others, which learn
    what they need in one message (or rank 0's error, raised alike; or that there is none).

    Called by every rank at the same point (``mlxspec.speculative.make_drafter``).
    """
    if group.rank() != 0:
        _, message = receive(group)
        if "error" in message:
            raise DistributedError(f"rank 0 could not build its drafter: {message['error']}")
        if message.get("none"):
            return None
        return FollowerDrafter(message["name"], message["reason"], message["taps"])
    try:
        drafter = build()
        if drafter is None:
            message = {"none": True}
        else:
            target = drafter.target_model(model)
            message = {"name": drafter.name, "reason": drafter.unsupported_reason(),
                       "taps": getattr(target, "taps", None)}
    except Exception as e:
        send(MESSAGE, {"error": str(e).strip() or type(e).__name__}, group)
        raise
    send(MESSAGE, message, group)
    return drafter
