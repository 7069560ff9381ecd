"""A feature draft and prompt lookup together: each pass takes the run that is likelier to hold.

Prompt lookup wins where the output copies the input (editing, code rewrites) and costs nothing;
the feature draft wins on free text. Per pass, a lookup match of at least ``min_ngram`` tokens
(the context's last ``min_ngram`` tokens occurred before, so the copy is likely to continue) is
proposed as it is (deterministic, q one-hot); otherwise the feature draft drafts. Both follow
the whole context, and the target's verifying passes keep recording the features, so the head
catches up in one forward when it drafts again. Verification is the same as for either alone.

With auto-k each drafter has its own planner (``PairPlanner``): its own acceptance, drafting
cost, draft length and pauses, the target's pass costs shared. One planner for the pair fitted
one k to both (the head's acceptance kept it at 1-3 and cut lookup's long copies short) and
paused both where the head did not pay, lookup's copies included (docs/feature-drafts.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.nn as nn

from mlxspec.sampling import SamplingParams
from mlxspec.speculative.drafters import Draft, Drafter, PromptLookupDrafter, _draft_of
from mlxspec.speculative.feature import FeatureDrafter
from mlxspec.speculative.planner import DraftLengthPlanner, PassCosts


class CombinedDrafter(Drafter):
    """Prompt lookup when it matches ``min_ngram`` tokens or more, else the feature draft.

    Args:
        feature: the feature drafter (its target forward is the loop's target).
        lookup: a prompt-lookup drafter (``ngram_max`` >= ``min_ngram``).
        min_ngram: the shortest match whose continuation is proposed instead of the head's.
    """

    name = "eagle-3 + prompt lookup"

    def __init__(self, feature: FeatureDrafter, lookup: PromptLookupDrafter, min_ngram: int = 2):
        super().__init__()
        self.feature, self.lookup, self.min_ngram = feature, lookup, min_ngram
        self.step_seconds, self.catch_up_seconds = feature.step_seconds, feature.catch_up_seconds
        self.from_lookup = 0  # passes drafted by lookup (a statistic)
        # Lookup's planner measurements; the target's pass costs are the head's planner's, shared.
        self.lookup_costs = PassCosts(verify=self.pass_costs.verify)

    def lookup_turn(self) -> bool:
        """Whether lookup drafts the next pass (a match of ``min_ngram`` tokens or more)."""
        return self.lookup.match(1)[0] >= self.min_ngram

    def planner(self, num_draft_tokens: int | str, sampling: SamplingParams) -> PairPlanner:
        return PairPlanner(self, num_draft_tokens, sampling)

    def target_model(self, model: nn.Module) -> Any:
        return self.feature.target_model(model)

    def begin(self, context: Sequence[int]) -> None:
        super().begin(context)
        for drafter in (self.feature, self.lookup):
            drafter.prefix = self.prefix
            drafter.begin(context)

    def extend(self, tokens: Sequence[int]) -> None:
        super().extend(tokens)
        self.feature.extend(tokens)
        self.lookup.extend(tokens)

    def unseen(self) -> int:
        return self.feature.unseen()

    def propose(self, k, sampling, logits_processor=None, keys=None) -> Draft:
        if k == 0:
            return _draft_of([])
        n, tokens = self.lookup.match(k)
        if n >= self.min_ngram:
            self.from_lookup += 1
            return _draft_of(tokens)
        return self.feature.propose(k, sampling, logits_processor, keys)

    def reset(self) -> None:
        super().reset()
        self.feature.reset()
        self.lookup.reset()


class PairPlanner:
    """Auto-k for a ``CombinedDrafter``: a ``DraftLengthPlanner`` per drafter, each asked on the
    passes its drafter drafts, with the same interface as one.

    A pause of one does not stop the other: a plain stretch run for the head's pause ends (after
    the pass already queued) as soon as lookup's turn comes and lookup's planner is ready, and the
    other way round; a turn of a paused drafter during the other's stretch counts toward its
    own pause.
    """

    interruptible = True  # the other drafter's turn may end a plain stretch early

    def __init__(self, pair: CombinedDrafter, num_draft_tokens: int | str,
                 sampling: SamplingParams):
        self.pair = pair
        feature = pair.feature
        self.head = DraftLengthPlanner(num_draft_tokens, feature.step_seconds,
                                       feature.catch_up_seconds, pair.pass_costs,
                                       greedy=sampling.greedy)
        self.lookup = DraftLengthPlanner(num_draft_tokens, 0.0, 0.0, pair.lookup_costs,
                                         greedy=sampling.greedy)
        self.fixed = self.head.fixed
        self.active = self.head  # the planner of the pass (or plain stretch) under way

    def _turn(self) -> DraftLengthPlanner:
        return self.lookup if self.pair.lookup_turn() else self.head

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        for planner in (self.head, self.lookup):
            planner.observe_prefill(tokens, seconds)

    def choose(self, limit: int, catch_up: int = 0) -> int:
        self.active = self._turn()
        return self.active.choose(limit, catch_up if self.active is self.head else 0)

    def observe(self, *args, **kwargs) -> None:
        self.active.observe(*args, **kwargs)

    def plain_stretch(self, limit: int) -> int:
        return self.active.plain_stretch(limit)

    def plain_stretch_ended(self, unused: int) -> None:
        self.active.plain_stretch_ended(unused)

    def interrupts(self) -> bool:
        turn = self._turn()
        if turn is self.active:
            return False
        if turn.ready():
            return True
        turn.pass_by()
        return False
