"""Speculation with a sharded target, drafted on rank 0 alone: rank 0's drafter proposes, the
proposals reach the other ranks in one all-sum per pass, and every rank verifies the same tokens
in the same sharded pass. The accepted tokens follow from the verification, which each rank
computes alike, so every rank's caches stay the same without another message.

The message is one int32 vector of ``k + 1`` words, ``[n, d1..dn, 0...]``, to which only rank 0
contributes (the others add zeros, so the sum is exact), sent as :mod:`follow`'s messages are: on
the stream of the forward passes, so it pairs with the same collective on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mlxspec.distributed.group import ordered_all_sum
from mlxspec.speculative.drafters import Draft, Drafter


class SharedDrafter(Drafter):
    """``inner`` on rank 0; its proposals, sent over ``group``, on the others, which draft nothing.

    Only the proposed tokens travel, not the distributions they were drawn from: use it where
    verification does not read them (greedy decoding, or seeded sampling, as every sharded run
    samples: :func:`~mlxspec.distributed.agreed_decoding`). Rank 0's context is the inner
    drafter's own; the followers' inner drafter is left untouched.
    """

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

    def propose(self, k: int, sampling: Any, logits_processor: Any = None,
                keys: Any = None) -> Draft:
        """Rank 0's proposal of at most ``k`` tokens, on every rank: (n,) uint32."""
        words, caught_up = np.zeros(k + 1, np.int32), 0
        if self.leader:
            draft = self.inner.propose(k, sampling, logits_processor, keys)
            tokens, caught_up = draft.tokens[:k], draft.caught_up
            words[0], words[1:1 + len(tokens)] = len(tokens), tokens
        shared = ordered_all_sum(words, self.group)
        return Draft(mx.array(shared[1:1 + int(shared[0])], mx.uint32), caught_up=caught_up)

    def unseen(self) -> int:
        # Read only by the timing-based draft length, which sharded runs do not use (a fixed k).
        return self.inner.unseen() if self.leader else 0

    def unsupported_reason(self) -> str | None:
        return self.inner.unsupported_reason()

    def reset(self) -> None:
        self.inner.reset()


def share_drafter(draft: Drafter, group: mx.distributed.Group) -> Drafter:
    """``draft`` drafting on rank 0 alone (:class:`SharedDrafter`), or ``draft`` itself where it
    reads the target's own pass (a feature draft taps the hidden states every rank computes:
    each rank drafts alike there)."""
    if type(draft).target_model is not Drafter.target_model:
        return draft
    return SharedDrafter(draft, group)
