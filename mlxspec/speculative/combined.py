"""A feature draft and prompt lookup together: each pass takes the run that is likelier to hold.

Prompt lookup wins where the output copies the input (editing, code rewrites) and costs nothing;
the feature draft wins on free text. Per pass, a lookup match of at least ``min_ngram`` tokens
(the context's last ``min_ngram`` tokens occurred before, so the copy is likely to continue) is
proposed as it is (deterministic, q one-hot); otherwise the feature draft drafts. Both follow
the whole context, and the target's verifying passes keep recording the features, so the head
catches up in one forward when it drafts again. Verification is the same as for either alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.nn as nn

from mlxspec.speculative.drafters import Draft, Drafter, PromptLookupDrafter, _draft_of
from mlxspec.speculative.feature import FeatureDrafter


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
