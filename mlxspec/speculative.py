"""Speculative decoding: draft k tokens, verify them in one target forward, keep the target's own.

One step (Leviathan et al. 2023; Chen et al. 2023):

1. a drafter proposes d1..dk with the distributions q1..qk they were drawn from (or
   deterministically: q one-hot);
2. the target runs once over ``[last, d1..dk]`` and gives p0..pk, after the same logits
   processors (same token history) and the same temperature/top-p/min-p/top-k transform as plain
   decoding;
3. greedy: accept the longest prefix with d_i == argmax p_{i-1}, then emit the target's argmax.
   Sampling: accept d_i with probability min(1, p(d_i) / q(d_i)); at the first rejection emit a
   sample of normalize(max(0, p - q)); if all k are accepted emit a sample of p_k. Each emitted
   token is then distributed exactly as in plain decoding from the target;
4. both KV caches roll back to the accepted tokens (sliding-window caches through
   ``mlxspec.window_cache``).

``speculative_generate_step`` is the loop; ``DraftLengthPlanner`` (mlxspec.draft_planner) picks k.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from mlxspec.draft_planner import DraftLengthPlanner, SpecStats
from mlxspec.drafters import (
    PREFILL_STEP,
    Draft,
    Drafter,
    DraftModelDrafter,
    Process,
    PromptLookupDrafter,
    check_tokenizers,
    output_width,
    real_vocab_size,
)
from mlxspec.errors import TokenizerMismatchError, UnsupportedModelError
from mlxspec.generate import LogitsProcessor, SamplingParams
from mlxspec.sampling import normalized_logprobs, processed_probs, sample
from mlxspec.window_cache import WindowKVCache, cannot_roll_back

__all__ = [
    "Drafter",
    "DraftModelDrafter",
    "PromptLookupDrafter",
    "SpecStats",
    "SpeculativeFallbackWarning",
    "check_tokenizers",
    "make_drafter",
    "speculative_generate_step",
    "verify_greedy",
    "verify_sampling",
]

ROLLBACK_SLACK = 32  # tokens a sliding-window cache keeps beyond its window (> auto's K_MAX)


class SpeculativeFallbackWarning(UserWarning):
    """Speculative decoding could not run and plain decoding was used instead."""


# -- verification -----------------------------------------------------------------------------


def verify_greedy(target_logprobs: mx.array, draft_tokens: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy verification.

    Args:
        target_logprobs: (..., k+1, vocab) target log-probabilities after ``[last, d1..dk]``.
        draft_tokens: (..., k) proposed tokens d1..dk.

    Returns:
        ``(accepted, token)``, both (...): how many drafts equal the target's argmax, and the
        target's own token after them.
    """
    target_tokens = mx.argmax(target_logprobs, axis=-1)  # what plain greedy decoding would emit
    agree = (target_tokens[..., :-1] == draft_tokens).astype(mx.int32)
    accepted = mx.cumprod(agree, axis=-1).sum(axis=-1)  # length of the agreeing prefix
    token = mx.take_along_axis(target_tokens, accepted[..., None], axis=-1)[..., 0]
    return accepted, token


def verify_sampling(
    p: mx.array, q: mx.array | None, draft_tokens: mx.array
) -> tuple[mx.array, mx.array]:
    """Rejection-sampling verification (Leviathan et al. 2023, Algorithm 1).

    Args:
        p: (..., k+1, vocab) target probabilities after ``[last, d1..dk]`` (processed).
        q: (..., k, vocab) draft probabilities d1..dk were drawn from, or ``None`` for
            deterministic proposals (q one-hot).
        draft_tokens: (..., k) proposed tokens.

    Returns:
        ``(accepted, token)``, both (...): how many drafts are kept, and the token emitted after
        them (a residual sample at the first rejection, or a sample of p_k if all are kept).
    """
    if q is None:  # deterministic proposals: q is one-hot on each draft token
        q = (mx.arange(p.shape[-1]) == draft_tokens[..., None]).astype(p.dtype)
    d = draft_tokens[..., None]
    p_d = mx.take_along_axis(p[..., :-1, :], d, axis=-1)[..., 0]  # p_i(d_i)
    q_d = mx.take_along_axis(q, d, axis=-1)[..., 0]  # q_i(d_i)
    u = mx.random.uniform(shape=p_d.shape)
    keep = (u * q_d < p_d).astype(mx.int32)  # accept d_i with probability min(1, p/q)
    accepted = mx.cumprod(keep, axis=-1).sum(axis=-1)  # drafts before the first rejection
    # The row after the accepted drafts: p - q there, or p_k (q = 0) after a full acceptance.
    q = mx.concatenate([q, mx.zeros((*q.shape[:-2], 1, q.shape[-1]), q.dtype)], axis=-2)
    at = accepted[..., None, None]
    p_row = mx.take_along_axis(p, at, axis=-2)[..., 0, :]
    residual = mx.maximum(p_row - mx.take_along_axis(q, at, axis=-2)[..., 0, :], 0)
    # p == q leaves no residual mass; such a row is only reached through rounding: use p.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p_row)
    return accepted, sample(residual)


# -- the decoding loop ------------------------------------------------------------------------


def _target_logprobs(
    model: nn.Module,
    cache: list[Any],
    inputs: mx.array,
    history: mx.array,
    processors: Sequence[LogitsProcessor] | None,
) -> mx.array:
    """(n, vocab) normalized log-probabilities after each of ``inputs`` (n,), as generate_step.

    Each position's logits processors see the token history up to and including its input.
    """
    logits = model(inputs[None], cache=cache)[0]
    if processors:
        rows = []
        for i in range(inputs.size):
            seen = mx.concatenate([history, inputs[: i + 1]])
            row = logits[i : i + 1]
            for processor in processors:
                row = processor(seen, row)
            rows.append(row)
        logits = mx.concatenate(rows)
    return normalized_logprobs(logits)


def _plain_steps(
    model: nn.Module,
    cache: list[Any],
    last: mx.array,
    history: mx.array,
    processors: Sequence[LogitsProcessor] | None,
    sampler: Callable[[mx.array], mx.array],
    count: int,
) -> Iterator[tuple[mx.array, mx.array]]:
    """``count`` plain decoding steps after ``last`` (1,), pipelined as mlx-lm's generate_step.

    The next step is queued before the current token is handed out, so building the graph
    overlaps with computing it. Like a speculative pass, it leaves the last token out of the cache.
    Yields ``(token (1,) uint32, logprobs (vocab,))``.
    """

    def step(y: mx.array, seen: mx.array) -> tuple[mx.array, mx.array]:
        logprobs = _target_logprobs(model, cache, y, seen, processors)
        return sampler(logprobs).astype(mx.uint32), logprobs[0]

    token, logprobs = step(last, history)
    mx.async_eval(token, logprobs)
    for i in range(count):
        if i + 1 < count:  # queue the next step on the (not yet computed) token
            history = mx.concatenate([history, last.astype(history.dtype)])
            last = token
            next_token, next_logprobs = step(token, history)
            mx.async_eval(next_token, next_logprobs)
        yield token, logprobs
        if i + 1 < count:
            token, logprobs = next_token, next_logprobs


def _draft_process(processors: Sequence[LogitsProcessor] | None, seen: mx.array) -> Process | None:
    """The target's logits processors for the draft model: history = ``seen`` + drafted tokens."""
    if not processors:
        return None

    def process(drafted: mx.array, logits: mx.array) -> mx.array:
        tokens = mx.concatenate([seen, drafted])
        for processor in processors:
            logits = processor(tokens, logits)
        return logits

    return process


def _propose(
    draft: Drafter,
    context: list[int],
    k: int,
    sampling: SamplingParams,
    processors: Sequence[LogitsProcessor] | None,
    seen: mx.array,
) -> Draft:
    """The drafter's proposal of up to k tokens (none for k = 0: a plain decoding step)."""
    if k == 0:
        return Draft([])
    return draft.propose(context, k, sampling, _draft_process(processors, seen))


def _prefill(model: nn.Module, cache: list[Any], tokens: mx.array) -> None:
    """Run ``tokens`` through the model into ``cache`` in chunks, as mlx-lm's generate_step."""
    while tokens.size > 0:
        model(tokens[None, :PREFILL_STEP], cache=cache)
        mx.eval([c.state for c in cache])
        tokens = tokens[PREFILL_STEP:]
        mx.clear_cache()


def _trim(cache: list[Any], n: int) -> None:
    """Drop the latest ``n`` tokens from every layer's cache (they always can: see ROLLBACK_SLACK)."""
    if n > 0:
        for c in cache:
            if c.trim(n) != n:
                raise RuntimeError(f"{type(c).__name__} could not roll back {n} tokens")


def _swap_in_window_caches(cache: list[Any], slack: int) -> dict[int, RotatingKVCache]:
    """Replace each RotatingKVCache in ``cache`` by a WindowKVCache; returns the originals."""
    originals = {i: c for i, c in enumerate(cache) if isinstance(c, RotatingKVCache)}
    for i, rotating in originals.items():
        cache[i] = WindowKVCache.from_rotating(rotating, slack=slack)
    return originals


def _swap_back(cache: list[Any], originals: dict[int, RotatingKVCache]) -> None:
    for i, rotating in originals.items():
        cache[i].to_rotating(rotating)
        cache[i] = rotating


def _cache_offset(cache: list[Any]) -> int:
    return int(getattr(cache[0], "offset", 0)) if cache else 0


def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    draft: Drafter,
    *,
    sampling: SamplingParams,
    max_tokens: int,
    prompt_cache: list[Any] | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    num_draft_tokens: int | str = "auto",
    stats: SpecStats | None = None,
) -> Iterator[tuple[int, mx.array, bool]]:
    """Speculative decoding with the output distribution of plain decoding from ``model``.

    Args:
        prompt: (seq,) int32 token ids not yet in ``prompt_cache``.
        model: the target model.
        draft: a drafter (``make_drafter``).
        sampling: how tokens are drawn (``temp=0``: greedy, token for token as plain decoding).
        max_tokens: the most tokens to yield.
        prompt_cache: the target's cache (updated in place; left holding at most the yielded
            tokens, with its original cache types).
        logits_processors: mlx-lm processors; they see the prompt and all tokens so far.
        num_draft_tokens: draft length per step, or ``"auto"`` (see ``DraftLengthPlanner``).
        stats: filled in as tokens are produced.

    Yields:
        ``(token, logprobs (vocab,), from_draft)``.
    """
    stats = stats if stats is not None else SpecStats()
    stats.num_draft_tokens = num_draft_tokens
    stats.drafter = draft.name
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model)
    reason = cannot_roll_back(prompt_cache) or draft.unsupported_reason()
    if reason is not None:  # never crash on a cache we cannot roll back: decode plainly
        stats.fallback = reason
        warnings.warn(
            f"speculative decoding is off: {reason}; decoding without a draft",
            SpeculativeFallbackWarning,
            stacklevel=2,
        )
        for token, logprobs in generate_step(
            prompt,
            model,
            max_tokens=max_tokens,
            sampler=sampling.sampler(),
            logits_processors=logits_processors,
            prompt_cache=prompt_cache,
        ):
            stats.record(k=0, drafted=0, accepted=0, emitted=1, draft_s=0.0, verify_s=0.0)
            yield token, logprobs, False
        return

    # The drafter sees the whole context: what the cache held before (if the caller told it).
    prefix = list(draft.prefix) if len(draft.prefix) == _cache_offset(prompt_cache) else []
    planner = DraftLengthPlanner(num_draft_tokens, draft.step_seconds, draft.catch_up_seconds)
    tic = time.perf_counter()
    _prefill(model, prompt_cache, prompt[:-1])
    planner.observe_prefill(prompt.size - 1, time.perf_counter() - tic)
    # Sliding-window caches keep enough extra tokens to roll back any draft.
    slack = max(ROLLBACK_SLACK, planner.fixed + 1 if planner.fixed else 0)
    originals = _swap_in_window_caches(prompt_cache, slack)

    context = prefix + prompt.tolist()  # every token the target conditions on
    history = prompt[:-1]  # what logits processors see, as in generate_step (prompt included)
    last = prompt[-1:].astype(mx.uint32)  # the next pass starts from it (not yet in the cache)
    generated = 0
    unyielded = 0  # accepted drafts in the target cache that the caller has not received
    greedy = sampling.temp == 0
    sampler = sampling.sampler()  # mlx-lm's, for the plain stretches
    try:
        while generated < max_tokens:
            # 1. Draft (k = 0: a plain decoding step).
            k = planner.choose(max_tokens - generated - 1, draft.unseen(context))
            stretch = planner.plain_stretch(max_tokens - generated) if k == 0 else 1
            if stretch > 1:  # speculation is paused: plain decoding, pipelined
                tic, tokens = time.perf_counter(), []
                for token, logprobs in _plain_steps(
                    model, prompt_cache, last, history, logits_processors, sampler, stretch
                ):
                    tokens.append(token.item())
                    step_s = time.perf_counter() - tic
                    planner.observe(0, 0, 0, 0.0, step_s, 0)
                    stats.record(0, 0, 0, 1, 0.0, step_s)
                    yield tokens[-1], logprobs, False
                    tic = time.perf_counter()  # the caller's time is not ours
                seen = [last.item(), *tokens[:-1]]  # now in the cache
                history = mx.concatenate([history, mx.array(seen, history.dtype)])
                context += tokens
                generated += stretch
                last = mx.array(tokens[-1:], mx.uint32)
                continue
            tic = time.perf_counter()
            seen = mx.concatenate([history, last.astype(history.dtype)])
            proposal = _propose(draft, context, k, sampling, logits_processors, seen)
            draft_s = time.perf_counter() - tic
            tokens = proposal.tokens[:k]
            drafts = mx.array(tokens, mx.uint32)

            # 2. Verify all drafts in one target pass over [last, d1..dk].
            tic = time.perf_counter()
            inputs = mx.concatenate([last, drafts])
            logprobs = _target_logprobs(model, prompt_cache, inputs, history, logits_processors)
            unyielded = len(tokens)  # the drafts are in the cache, not yet verified
            if greedy:
                accepted, token = verify_greedy(logprobs, drafts)
            else:
                q = None if proposal.probs is None else proposal.probs[: len(tokens)]
                accepted, token = verify_sampling(processed_probs(logprobs, sampling), q, drafts)
            mx.eval(accepted, token, logprobs)
            n, token = accepted.item(), token.item()
            verify_s = time.perf_counter() - tic

            # 3. Roll the target cache back to [.., last, d1..dn]; the drafter re-syncs itself.
            _trim(prompt_cache, len(tokens) - n)
            unyielded = n
            planner.observe(k, len(tokens), n, draft_s, verify_s, proposal.fed)
            emitted = tokens[:n] + [token]
            stats.record(k, len(tokens), n, len(emitted), draft_s, verify_s)
            history = mx.concatenate([history, inputs[: n + 1].astype(history.dtype)])
            context += emitted
            generated += len(emitted)
            last = mx.array([token], mx.uint32)
            for i, t in enumerate(emitted):
                unyielded = max(n - i - 1, 0)  # if the caller stops here, these leave the cache
                yield t, logprobs[i], i < n
            if generated % 256 < len(emitted):
                mx.clear_cache()
    finally:
        _trim(prompt_cache, unyielded)
        _swap_back(prompt_cache, originals)


# -- building a drafter -----------------------------------------------------------------------


def make_drafter(
    tokenizer: Any,
    model: nn.Module,
    *,
    draft_model: nn.Module | None = None,
    draft_tokenizer: Any = None,
    prompt_lookup: bool = False,
    ngram_max: int = 3,
    max_kv_size: int | None = None,
) -> Drafter:
    """The drafter for a target ``model``: a draft model sharing its tokenizer, or prompt lookup.

    Args:
        tokenizer: the target's tokenizer.
        draft_model: a smaller model with the same tokenizer (checked when ``draft_tokenizer`` is
            given; without it only the vocabulary sizes can be compared).
        prompt_lookup: draft by n-gram lookup in the prompt and output instead (no model).
        ngram_max: longest n-gram prompt lookup matches.
        max_kv_size: a sliding-window cache of this many tokens for the draft model.

    Raises:
        TokenizerMismatchError: the draft does not share the target's tokenizer.
        UnsupportedModelError: both a draft model and prompt lookup, or neither.
    """
    if (draft_model is None) == (not prompt_lookup):
        raise UnsupportedModelError(
            "choose one way to draft: a draft model or prompt lookup (not both, not neither)"
        )
    if prompt_lookup:
        return PromptLookupDrafter(ngram_max=ngram_max)
    if draft_tokenizer is not None:
        check_tokenizers(tokenizer, draft_tokenizer)
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
    )
