"""A feature draft and prompt lookup together: each pass takes the run that is likelier to hold.

Prompt lookup wins where the output copies the input (editing, code rewrites) and costs nothing;
the feature draft wins on free text. Per pass, a lookup match of at least ``min_ngram`` tokens
(the context's last ``min_ngram`` tokens occurred before, so the copy is likely to continue) is
proposed as it is (deterministic, q one-hot); otherwise the feature draft drafts. Both follow
the whole context, and the target's verifying passes keep recording the features, so the head
catches up in one forward when it drafts again. Verification is the same as for either alone.

With auto-k, a lookup run gets its own length: the planner's k fits the acceptance of both
drafts together, which the head's keeps low, and cut lookup's long copies short. Lookup's own
acceptance is kept here (greedy and sampled apart) and a run made longer than k where the same
measured pass costs, drafting being free, say that a longer run pays
(docs/feature-drafts.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.nn as nn

from mlxspec.sampling import SamplingParams
from mlxspec.speculative.drafters import Draft, Drafter, PromptLookupDrafter, _draft_of
from mlxspec.speculative.feature import FeatureDrafter
from mlxspec.speculative.planner import AcceptanceCount, free_draft_length


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
        # Lookup's acceptance, counted as the planner counts, greedy and sampled apart (by
        # sampling.greedy): a copy kept whole at T = 0 is cut short by sampling.
        self.lookup_counts = {True: AcceptanceCount.prior(), False: AcceptanceCount.prior()}
        self.lookup_run: tuple[list[int], bool] | None = None  # proposed, awaiting its verdict

    def lookup_acceptance(self, greedy: bool) -> float:
        return self.lookup_counts[greedy].rate

    def target_model(self, model: nn.Module) -> Any:
        return self.feature.target_model(model)

    def begin(self, context: Sequence[int]) -> None:
        super().begin(context)
        self.lookup_run = None  # a pass interrupted before its verdict (an error, Ctrl-C)
        for drafter in (self.feature, self.lookup):
            drafter.prefix = self.prefix
            drafter.begin(context)

    def extend(self, tokens: Sequence[int]) -> None:
        if self.lookup_run is not None:  # tokens: the kept drafts and the target's own
            (run, greedy), kept = self.lookup_run, 0
            # the last token is the target's own: never a kept draft (a run the loop cut short
            # for a grammar counts as missed past the cut)
            while kept < min(len(run), len(tokens) - 1) and run[kept] == tokens[kept]:
                kept += 1
            self.lookup_counts[greedy].record(kept, len(run))
            self.lookup_run = None
        super().extend(tokens)
        self.feature.extend(tokens)
        self.lookup.extend(tokens)

    def unseen(self) -> int:
        return self.feature.unseen()

    def draft_length(self, k: int, limit: int, sampling: SamplingParams) -> int:
        if self.lookup.match(1)[0] < self.min_ngram:
            return k  # the head drafts
        # Only ever longer: where lookup's runs fare worse than the pair, k already fits them.
        acceptance = self.lookup_acceptance(sampling.greedy)
        return max(k, free_draft_length(self.pass_costs, acceptance, limit))

    def propose(self, k, sampling, logits_processor=None, keys=None) -> Draft:
        self.lookup_run = None
        if k == 0:
            return _draft_of([])
        n, tokens = self.lookup.match(k)
        if n >= self.min_ngram:
            self.from_lookup += 1
            self.lookup_run = (tokens, sampling.greedy)
            return _draft_of(tokens)
        return self.feature.propose(k, sampling, logits_processor, keys)

    def reset(self) -> None:
        super().reset()
        self.lookup_run = None
        self.feature.reset()
        self.lookup.reset()
