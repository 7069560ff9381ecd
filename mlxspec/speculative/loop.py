"""The speculative decoding loop: draft k tokens, verify them in one target pass, keep the target's.

One pass (Leviathan et al. 2023; Chen et al. 2023; gpt-fast's ``speculative_decode``):

1. the drafter proposes d1..dk with the distributions q1..qk it drew them from;
2. the target runs once over ``[last, d1..dk]`` (``last``: the newest token, not yet in the cache)
   and gives p0..pk, after the same logits processors (same token history) and the same
   temperature/top-p/min-p/top-k transform as plain decoding;
3. ``mlxspec.speculative.verify`` keeps d1..dn and adds the target's own token: n + 1 tokens;
4. the target cache rolls back the k - n rejected drafts (sliding windows included, through
   ``mlxspec.cache.WindowKVCache``); the drafter is told the emitted tokens.

``DraftLengthPlanner`` picks k before every pass; k = 0 runs plain decoding steps (pipelined),
and so does a drafter with nothing to propose (prompt lookup without a match) until it has.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache

from mlxspec.cache import (
    ROLLBACK_SLACK,
    cache_offset,
    cannot_roll_back,
    make_cache,
    of_whole_prompt,
    prefill,
    swap_back,
    swap_in_window_caches,
    trim_cache,
)
from mlxspec.errors import UnsupportedModelError
from mlxspec.sampling import (
    LogitsProcessor,
    SamplingParams,
    normalized_logprobs,
    position_key,
    processed_logprobs,
    processed_probs,
)
from mlxspec.speculative.drafters import Drafter
from mlxspec.speculative.planner import K_MAX
from mlxspec.speculative.stats import SpecStats
from mlxspec.speculative.verify import verify_greedy, verify_sampling, verify_seeded


def unsupported_reason(prompt_cache: list[Any], draft: Drafter) -> str | None:
    """Why speculative decoding cannot run with this cache and drafter, or None."""
    return cannot_roll_back(prompt_cache) or draft.unsupported_reason()


def _target_logprobs(
    model: nn.Module,
    cache: list[Any],
    inputs: mx.array,
    history: mx.array | None,
    processors: Sequence[LogitsProcessor] | None,
) -> mx.array:
    """(n, vocab) normalized log-probabilities after each of ``inputs`` (n,), as generate_step.

    Each position's logits processors see the token history up to and including its input.
    """
    logits = model(inputs[None], cache=cache)[0]
    if processors:
        rows = []
        for i in range(inputs.size):
            seen = mx.concatenate([history, inputs[: i + 1].astype(history.dtype)])
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
    history: mx.array | None,
    processors: Sequence[LogitsProcessor] | None,
    sampler: Callable[[mx.array], mx.array],
    count: int,
    stop: Callable[[], bool] | None = None,
    after_forward: Callable[[], None] | None = None,
) -> Iterator[tuple[mx.array, mx.array]]:
    """Up to ``count`` plain decoding steps after ``last`` (1,), pipelined as mlx-lm's
    generate_step.

    The next step is queued before the current token is handed out, so building the graph
    overlaps with computing it. Like a speculative pass, it leaves the last token out of the cache.
    ``stop()``, asked after each token is handed out, ends the steps after the one queued then
    (its forward has already put the token into the cache). ``after_forward()`` runs after each
    step's forward is built, as generate_step quantizes the KV cache. Yields ``(token (1,)
    uint32, logprobs (vocab,))``.
    """

    def step(y: mx.array, seen: mx.array | None) -> tuple[mx.array, mx.array]:
        logprobs = _target_logprobs(model, cache, y, seen, processors)
        if after_forward is not None:
            after_forward()
        return sampler(logprobs).astype(mx.uint32), logprobs[0]

    token, logprobs = step(last, history)
    mx.async_eval(token, logprobs)
    i = 0
    while i < count:
        queued = i + 1 < count
        if queued:  # queue the next step on the (not yet computed) token
            if processors:
                history = mx.concatenate([history, last.astype(history.dtype)])
            last = token
            next_token, next_logprobs = step(token, history)
            mx.async_eval(next_token, next_logprobs)
        yield token, logprobs
        if queued:
            if stop is not None and stop():
                count = i + 2
            token, logprobs = next_token, next_logprobs
        i += 1


def _asked_only(stop: Callable[[], bool]) -> Callable[[], bool]:
    """``stop`` asked after each token as before (a pair planner counts the other drafter's
    turns there), its answer not followed: the plain stretch runs whole."""

    def asked() -> bool:
        stop()
        return False

    return asked


def _draft_limit(left: int, cache: list[Any], kv_bits: int | None, quantized_kv_start: int) -> int:
    """The most drafts the next pass may verify: ``left - 1``, and with a KV cache still to
    quantize, none past the row after which generate_step would quantize it (the row whose
    write brings the cache to ``quantized_kv_start`` tokens): later rows of one pass would attend
    to keys it had quantized. The pass ends there; the loop quantizes after it."""
    if kv_bits is None or not any(hasattr(c, "to_quantized") for c in cache):
        return left - 1
    return min(left - 1, quantized_kv_start - cache_offset(cache) - 1)


def _valid_prefix(
    processors: Sequence[LogitsProcessor] | None, seen: mx.array | None, drafts: mx.array
) -> int:
    """How many of ``drafts`` to verify: all, unless a processor constrains the output (a
    grammar, ``mlxspec.grammar``) and refuses one; then those before it. A draft model's
    proposals went through the same processors and pass; prompt lookup's may not."""
    limit = drafts.size
    for processor in processors or ():
        if limit and hasattr(processor, "valid_prefix"):
            limit = min(limit, processor.valid_prefix(seen, drafts.tolist()[:limit]))
    return limit


def _draft_logits_processor(
    processors: Sequence[LogitsProcessor] | None, seen: mx.array | None
) -> Callable[[mx.array, mx.array], mx.array] | None:
    """The target's logits processors for the draft model: history = ``seen`` + drafted tokens."""
    if not processors:
        return None

    def process(drafted: mx.array, logits: mx.array) -> mx.array:
        tokens = mx.concatenate([seen, drafted.astype(seen.dtype)])
        for processor in processors:
            logits = processor(tokens, logits)
        return logits

    return process


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
    seed: int | None = None,
    prefill_step_size: int = 2048,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
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
        num_draft_tokens: draft length per pass, or ``"auto"`` (see ``DraftLengthPlanner``).
        stats: filled in as tokens are produced.
        seed: draw every token with its position's key (``verify_seeded``): the text is then the
            one seeded plain decoding gives, whatever k. None: rejection sampling, MLX's RNG.
        prefill_step_size, kv_bits, kv_group_size, quantized_kv_start: as mlx-lm's generate_step.
        prompt_progress_callback: ``(processed, total)`` prompt tokens, during the prefill.

    Yields:
        ``(token, logprobs (vocab,), from_draft)``.

    Raises:
        UnsupportedModelError: the cache or the drafter cannot roll back (``unsupported_reason``;
            ``mlxspec.generate`` decodes plainly instead).
    """
    stats = stats if stats is not None else SpecStats()
    stats.num_draft_tokens, stats.drafter = num_draft_tokens, draft.name
    prompt_cache = prompt_cache if prompt_cache is not None else make_cache(model)
    reason = unsupported_reason(prompt_cache, draft)
    if reason is not None:
        raise UnsupportedModelError(f"speculative decoding cannot run: {reason}")
    # A sharded target (mlxspec.distributed) drafts on rank 0 alone and sends the proposals to
    # the other ranks, without the distributions q, which greedy and seeded verification never
    # read: an unseeded sampled run takes its seed from MLX's generator, alike on every rank.
    share = getattr(model, "share_drafter", None)
    if share is not None:
        if seed is None and not sampling.greedy:
            seed = int(mx.random.randint(0, 2**31 - 1, ()).item())
        draft = share(draft)
    model = draft.target_model(model)  # a feature draft reads the verifying pass's hidden states
    processors = logits_processors or None
    seeded = seed is not None and not sampling.greedy
    position = cache_offset(prompt_cache) + prompt.size  # absolute position of the next token

    def quantize(cache: list[Any]) -> None:
        maybe_quantize_kv_cache(cache, quantized_kv_start, kv_group_size, kv_bits)

    # The drafter sees the whole context: what the cache held before (if the caller told it).
    # A one-off O(context) step, timed apart from the per-token drafting cost.
    tic = time.perf_counter()
    prefix = draft.prefix if len(draft.prefix) == cache_offset(prompt_cache) else []
    draft.begin([*prefix, *prompt.tolist()])
    stats.one_off_seconds = time.perf_counter() - tic
    planner = draft.planner(num_draft_tokens, sampling)

    with mx.stream(generation_stream):
        tic = time.perf_counter()
        prefill(model, prompt_cache, prompt[:-1], step_size=prefill_step_size,
                progress=of_whole_prompt(prompt_progress_callback, prompt.size),
                after_mlx_lm_chunk=quantize)
        planner.observe_prefill(prompt.size - 1, time.perf_counter() - tic)
    if prompt_progress_callback is not None:
        prompt_progress_callback(prompt.size, prompt.size)
    # Sliding-window caches keep enough extra tokens to roll back any draft.
    originals = swap_in_window_caches(prompt_cache, max(ROLLBACK_SLACK, (planner.fixed or 0) + 1))

    history = prompt[:-1] if processors else None  # what processors see, as in generate_step
    last = prompt[-1:].astype(mx.uint32)  # the next pass starts from it (not yet in the cache)
    generated = 0
    rollback_on_close = 0  # tokens in the target cache the caller has not received yet
    try:
        while generated < max_tokens:
            left = max_tokens - generated
            limit = _draft_limit(left, prompt_cache, kv_bits, quantized_kv_start)
            can_propose = draft.can_propose()  # prompt lookup: only on a match
            k = planner.choose(limit, draft.unseen()) if can_propose else 0
            # k = 0: plain steps, pipelined: the planner's pause, or until a draft can come
            planned = 0 if k else planner.plain_stretch(left) if can_propose else left
            stop = planner.interrupts if can_propose else draft.can_propose
            with mx.stream(generation_stream):
                # 1. Draft up to k tokens (a sharded target: rank 0's decision, every rank).
                tic = time.perf_counter()
                seen = mx.concatenate([history, last.astype(history.dtype)]) if processors else None
                keys = (lambda i, p=position: position_key(seed, p + i)) if seeded else None
                k, stretch, proposal = draft.agree(
                    k, planned, not can_propose or planner.interruptible,
                    max(min(planner.fixed or K_MAX, limit), 0),
                    lambda k=k, seen=seen, keys=keys: draft.propose(
                        k, sampling, _draft_logits_processor(processors, seen), keys))
            stats.decisions += 1
            if k == 0:
                if not draft.stops_early:
                    stop = _asked_only(stop)  # the ranks run the stretch they agreed on whole
                sampler = sampling.sampler(seed if seeded else None, position)
                tokens, times = [], []
                with mx.stream(generation_stream):
                    tic = time.perf_counter() - draft.round_seconds  # the stretch's decision
                    for token, logprobs in _plain_steps(
                        model, prompt_cache, last, history, processors, sampler, stretch,
                        stop=stop, after_forward=lambda: quantize(prompt_cache),
                    ):
                        tokens.append(token.item())
                        draft.extend(tokens[-1:])  # token by token: ``stop`` may ask it
                        times.append(time.perf_counter() - tic)
                        stats.record(0, 0, 0, 1, 0.0, times[-1])
                        yield tokens[-1], logprobs, False
                        if (generated + len(tokens)) % 256 == 0:
                            mx.clear_cache()
                        tic = time.perf_counter()  # the caller's time is not ours
                # A stretch's steps cost its time over its length: its first step was not
                # overlapped with building it, its last overlapped the caller's time (a stretch
                # cut to two steps measured ~18 and ~5 ms where a plain step took ~12). The
                # generation's first step is the planner's warm-up, observed alone.
                first = 1 if generated == 0 else 0
                rest = times[first:]
                for seconds in times[:first] + [sum(rest) / max(len(rest), 1)] * len(rest):
                    planner.observe(0, 0, 0, 0.0, seconds, 0)
                if can_propose:
                    planner.plain_stretch_ended(max(planned - len(tokens), 0))
                if processors:  # [last, t1..t_{n-1}] are now in the cache
                    seen = mx.array([last.item(), *tokens[:-1]], history.dtype)
                    history = mx.concatenate([history, seen])
                generated, position = generated + len(tokens), position + len(tokens)
                last = mx.array(tokens[-1:], mx.uint32)
                continue

            with mx.stream(generation_stream):
                # A model's drafts start computing now, while Python builds the verify pass on
                # them (~3.5 ms for SmolLM2 on a CPU): the two overlap where a GPU computes; a
                # 2-core CPU has little room for it (docs/feature-drafts.md).
                mx.async_eval(proposal.array, *(() if proposal.probs is None else (proposal.probs,)))
                drafts = proposal.array[:k]  # maybe not computed yet: one wait for the pass
                drafts = drafts[: _valid_prefix(processors, seen, drafts)]
                drafted = drafts.size
                # a sharded target's decision message is a cost of the pass, not of its drafts
                draft_s = time.perf_counter() - tic - draft.round_seconds

                # 2. Verify them all in one target pass over [last, d1..dk].
                tic = time.perf_counter() - draft.round_seconds
                inputs = mx.concatenate([last, drafts])
                logprobs = _target_logprobs(model, prompt_cache, inputs, history, processors)
                rollback_on_close = drafted  # the drafts are in the cache, not yet verified
                if sampling.greedy:
                    accepted, token = verify_greedy(logprobs, drafts)
                elif seeded:
                    row_keys = [position_key(seed, position + i) for i in range(drafted + 1)]
                    accepted, token = verify_seeded(
                        processed_logprobs(logprobs, sampling), drafts, row_keys
                    )
                else:
                    q = None if proposal.probs is None else proposal.probs[:drafted]
                    accepted, token = verify_sampling(
                        processed_probs(logprobs, sampling), q, drafts
                    )
                mx.eval(accepted, token, logprobs, drafts)
                n, token, tokens = accepted.item(), token.item(), drafts.tolist()

            # 3. Roll the target cache back to [.., last, d1..dn]; keep d1..dn and add token.
            if not trim_cache(prompt_cache, drafted - n):
                raise RuntimeError(f"the KV cache could not roll back {drafted - n} tokens")
            rollback_on_close = n
            emitted = tokens[:n] + [token]
            draft.extend(emitted)
            if processors:
                history = mx.concatenate([history, inputs[: n + 1].astype(history.dtype)])
            generated, position = generated + len(emitted), position + len(emitted)
            last = mx.array([token], mx.uint32)
            quantize(prompt_cache)
            # The pass's cost beyond drafting includes its bookkeeping (the drafter taking the
            # accepted tokens in, the rollback), as a plain step's time runs from one token to
            # the next: ~1.8 ms of a ~22 ms pass of SmolLM2 with its head at k = 3, which the
            # planner did not see when it compared the two.
            verify_s = time.perf_counter() - tic
            planner.observe(k, drafted, n, draft_s, verify_s, proposal.caught_up)
            stats.record(k, drafted, n, len(emitted), draft_s, verify_s)
            for i, t in enumerate(emitted):
                rollback_on_close = max(n - i - 1, 0)  # if the caller stops here, these leave
                yield t, logprobs[i], i < n
            if generated % 256 < len(emitted):
                mx.clear_cache()
    finally:
        trim_cache(prompt_cache, rollback_on_close)
        swap_back(prompt_cache, originals)
