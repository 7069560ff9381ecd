"""Speculative decoding: a drafter proposes tokens, the target verifies them in one pass.

- ``verify``: the acceptance rules (greedy, rejection sampling, seeded);
- ``drafters``: a draft model sharing the tokenizer, prompt lookup;
- ``feature``, ``eagle3``, ``heads``, ``mtp``: feature drafts (EAGLE-3 heads, MTP layers), which
  ``make_drafter`` pairs with prompt lookup (``combined``);
- ``draft_models``: drafts made from the target (early-exit copy, quantized copy);
- ``tokenizers``: the "same tokenizer" rule;
- ``planner``: how many tokens to draft per pass;
- ``stats``: what a generation reports;
- ``loop``: ``speculative_generate_step``, one pass top to bottom.

``mlxspec.generate`` is the one place that picks plain or speculative decoding.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.nn as nn

from mlxspec.errors import TokenizerMismatchError, UnsupportedModelError
from mlxspec.speculative.combined import CombinedDrafter
from mlxspec.speculative.draft_models import first_layers_copy, quantized_copy
from mlxspec.speculative.drafters import (
    Draft,
    Drafter,
    DraftModelDrafter,
    PromptLookupDrafter,
    output_width,
)
from mlxspec.speculative.heads import FeatureDraft, make_feature_drafter
from mlxspec.speculative.loop import speculative_generate_step, unsupported_reason
from mlxspec.speculative.planner import DraftLengthPlanner
from mlxspec.speculative.stats import SpecStats
from mlxspec.speculative.tokenizers import check_same_tokenizer, real_vocab_size
from mlxspec.speculative.verify import verify_greedy, verify_sampling, verify_seeded

__all__ = [
    "Draft",
    "DraftLengthPlanner",
    "Drafter",
    "DraftModelDrafter",
    "FeatureDraft",
    "PromptLookupDrafter",
    "SpecStats",
    "check_same_tokenizer",
    "first_layers_copy",
    "make_draft",
    "make_drafter",
    "make_feature_drafter",
    "quantized_copy",
    "speculative_generate_step",
    "unsupported_reason",
    "verify_greedy",
    "verify_sampling",
    "verify_seeded",
]


def make_drafter(
    tokenizer: Any,
    model: nn.Module,
    *,
    draft_model: nn.Module | None = None,
    draft_tokenizer: Any = None,
    prompt_lookup: bool = False,
    ngram_max: int = 3,
    max_kv_size: int | None = None,
    min_confidence: float = 0.0,
) -> Drafter | None:
    """The drafter for a target ``model``: a draft model sharing its tokenizer, prompt lookup,
    or a feature draft (``draft_model=FeatureDraft(...)``; None when ``"auto"`` finds no head).

    Args:
        tokenizer: the target's tokenizer.
        draft_model: a smaller model with the same tokenizer (checked when ``draft_tokenizer`` is
            given; without it only the vocabulary sizes can be compared).
        prompt_lookup: draft by n-gram lookup in the prompt and output instead (no model).
        ngram_max: longest n-gram prompt lookup matches.
        max_kv_size: a sliding-window cache of this many tokens for the draft model.
        min_confidence: the draft model stops drafting below this top probability (0: off).

    Raises:
        TokenizerMismatchError: the draft does not share the target's tokenizer.
        UnsupportedModelError: both a draft model and prompt lookup, or neither.
    """
    if (draft_model is None) == (not prompt_lookup):
        raise UnsupportedModelError(
            "choose one way to draft: a draft model or prompt lookup (not both, not neither)"
        )
    build = functools.partial(
        _build_drafter, tokenizer, model, draft_model=draft_model,
        draft_tokenizer=draft_tokenizer, prompt_lookup=prompt_lookup, ngram_max=ngram_max,
        max_kv_size=max_kv_size, min_confidence=min_confidence,
    )
    # A sharded target (mlxspec.distributed) builds and runs its drafter on rank 0 alone.
    on_rank_0 = getattr(model, "drafter_on_rank_0", None)
    return build() if on_rank_0 is None else on_rank_0(build)


def _build_drafter(
    tokenizer: Any,
    model: nn.Module,
    *,
    draft_model: nn.Module | None,
    draft_tokenizer: Any,
    prompt_lookup: bool,
    ngram_max: int,
    max_kv_size: int | None,
    min_confidence: float,
) -> Drafter | None:
    """:func:`make_drafter` once its arguments are checked."""
    if isinstance(draft_model, FeatureDraft):  # None when "auto" finds no head for the target
        feature = make_feature_drafter(draft_model.spec, model, tokenizer)
        # With prompt lookup, which proposes only where the context repeats and costs nothing:
        # on the default model's held-out prompts the pair is faster than the head alone
        # (bench/results/speculative.json, key feature_draft).
        return None if feature is None else CombinedDrafter(
            feature, PromptLookupDrafter(ngram_max=max(ngram_max, 2)))
    if prompt_lookup:
        return PromptLookupDrafter(ngram_max=ngram_max)
    if draft_tokenizer is not None:
        check_same_tokenizer(tokenizer, draft_tokenizer, "the draft model")
    vocab_size = output_width(model)
    if draft_tokenizer is None and output_width(draft_model) != vocab_size:
        raise TokenizerMismatchError(
            "the draft model's vocabulary size differs from the target's: pass its tokenizer "
            "(draft_tokenizer=...) so the tokenizers can be checked, or use a draft of the same family"
        )
    return DraftModelDrafter(
        draft_model,
        vocab_size=vocab_size,
        real_vocab=real_vocab_size(tokenizer),
        max_kv_size=max_kv_size,
        min_confidence=min_confidence,
    )


def make_draft(
    model: nn.Module,
    tokenizer: Any,
    *,
    draft_model: nn.Module | None = None,
    draft_tokenizer: Any = None,
    prompt_lookup: bool = False,
    ngram_max: int = 3,
    min_confidence: float = 0.0,
) -> Drafter | None:
    """The drafter a serving engine or batch job takes (``Engine(draft=...)``): a draft model,
    prompt lookup, or ``None`` when neither is asked for."""
    if draft_model is None and not prompt_lookup:
        return None
    return make_drafter(
        tokenizer,
        model,
        draft_model=draft_model,
        draft_tokenizer=draft_tokenizer,
        prompt_lookup=prompt_lookup,
        ngram_max=ngram_max,
        min_confidence=min_confidence,
    )
