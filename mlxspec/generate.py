"""Text generation over mlx-lm's decoding loop, with one place that chooses how tokens are produced.

``stream_generate`` yields mlx-lm ``GenerationResponse`` objects (extended with speculative
statistics); ``generate`` returns the whole text. ``token_generator`` is the single switch between
plain decoding (``mlx_lm.generate.generate_step``) and speculative decoding
(``mlxspec.speculative``), and the one place that falls back to plain decoding when speculation
cannot run. Arguments are checked here, at the API boundary (``InvalidArgumentError``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import (
    GenerationResponse,
    TextStateMachine,
    generate_step,
    generation_stream,
    maybe_quantize_kv_cache,
    wired_limit,
)
from mlx_lm.models.cache import RotatingKVCache
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlxspec.cache import WindowKVCache, cache_offset, make_cache, of_whole_prompt, prefill
from mlxspec.errors import InvalidArgumentError
from mlxspec.generation_checks import (
    check_context,
    check_generation_arguments,
    encode_prompt,
)
from mlxspec.sampling import LogitsProcessor, SamplingParams, check_seed
from mlxspec.speculative import (
    Drafter,
    SpecStats,
    make_drafter,
    speculative_generate_step,
    unsupported_reason,
)

__all__ = ["Response", "SamplingParams", "generate", "stream_generate", "token_generator"]


class SpeculativeFallbackWarning(UserWarning):
    """Speculative decoding could not run and plain decoding was used instead."""


@dataclass
class Response(GenerationResponse):
    """mlx-lm's ``GenerationResponse`` plus what mlxspec adds.

    Attributes (beyond mlx-lm's ``text``, ``token``, ``logprobs``, ``from_draft``,
    ``prompt_tokens``, ``prompt_tps``, ``generation_tokens``, ``generation_tps`` (measured from the
    end of the prompt prefill), ``peak_memory`` (GB), ``finish_reason``):
        spec_stats: speculative decoding statistics so far (``None`` for plain decoding).
    """

    spec_stats: SpecStats | None = None

    def as_dict(self, text: str, model_bytes: int | None = None) -> dict[str, Any]:
        """The JSON-ready summary of a finished generation (``mlxspec generate --json``).

        Args:
            text: the whole generated text (each response holds only its segment).
            model_bytes: the weights' size, to report the bandwidth achieved (bytes x tok/s).
        """
        result: dict[str, Any] = {
            "text": text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tps": self.prompt_tps,
            "generation_tokens": self.generation_tokens,
            "generation_tps": self.generation_tps,
            "peak_memory_gb": self.peak_memory,
        }
        if model_bytes is not None:
            result["model_bytes"] = model_bytes
            result["bandwidth_gbs"] = model_bytes * self.generation_tps / 1e9
        if self.spec_stats is not None:
            result["speculative"] = self.spec_stats.as_dict()
        return result


# -- the one switch ---------------------------------------------------------------------------


def token_generator(
    prompt: mx.array,
    model: nn.Module,
    *,
    sampling: SamplingParams,
    max_tokens: int,
    prompt_cache: list[Any] | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    draft: Drafter | None = None,
    num_draft_tokens: int | str = "auto",
    spec_stats: SpecStats | None = None,
    seed: int | None = None,
    prefill_step_size: int = 2048,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
) -> Iterator[tuple[int, mx.array | None, bool]]:
    """The one place that chooses how tokens are produced.

    Args:
        prompt: (seq,) int32 token ids not yet in ``prompt_cache``.
        draft: ``None`` for plain decoding, else a drafter (``mlxspec.speculative.make_drafter``).
            If the cache cannot roll back, plain decoding runs (``SpeculativeFallbackWarning``).
        seed: draw the token at absolute position p with ``position_key(seed, p)`` (both paths,
            so speculative and plain decoding give the same text for the same seed).
        Others: as ``stream_generate``.

    Yields:
        ``(token, logprobs (vocab,) or None, from_draft)``.
    """
    prompt_cache = prompt_cache if prompt_cache is not None else make_cache(model)
    if draft is not None:
        reason = unsupported_reason(prompt_cache, draft)
        if reason is None:
            yield from speculative_generate_step(
                prompt, model, draft, sampling=sampling, max_tokens=max_tokens,
                prompt_cache=prompt_cache, logits_processors=logits_processors,
                num_draft_tokens=num_draft_tokens, stats=spec_stats, seed=seed,
                prefill_step_size=prefill_step_size, kv_bits=kv_bits,
                kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
                prompt_progress_callback=prompt_progress_callback,
            )
            return
        if spec_stats is not None:
            spec_stats.fallback = reason
        warnings.warn(
            f"speculative decoding is off: {reason}; decoding without a draft",
            SpeculativeFallbackWarning,
            stacklevel=2,
        )
    # Plain decoding: mlxspec's interruptible prefill, then mlx-lm's generate_step. Its logits
    # processors see the whole prompt (generate_step only sees the last token).
    with mx.stream(generation_stream):
        prefill(model, prompt_cache, prompt[:-1], step_size=prefill_step_size,
                progress=of_whole_prompt(prompt_progress_callback, prompt.size),
                after_mlx_lm_chunk=lambda cache: maybe_quantize_kv_cache(
                    cache, quantized_kv_start, kv_group_size, kv_bits))
    if prompt_progress_callback is not None:
        prompt_progress_callback(prompt.size, prompt.size)
    processors = logits_processors
    if logits_processors and prompt.size > 1:
        processors = [_with_history(p, prompt[:-1]) for p in logits_processors]
    position = cache_offset(prompt_cache) + 1
    sampler = sampling.sampler(None if sampling.greedy else seed, position)
    for token, logprobs in generate_step(
        prompt[-1:], model, max_tokens=max_tokens, sampler=sampler,
        logits_processors=processors, prompt_cache=prompt_cache, prefill_step_size=prefill_step_size,
        kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
    ):
        if spec_stats is not None:
            spec_stats.record(0, 0, 0, 1, 0.0, 0.0)
        yield token, logprobs, False


def _with_history(processor: LogitsProcessor, before: mx.array) -> LogitsProcessor:
    """``processor`` seeing ``before`` ahead of the tokens generate_step gives it."""
    return lambda tokens, logits: processor(mx.concatenate([before, tokens.astype(before.dtype)]), logits)


def stop_text_state(stop: Sequence[str]) -> tuple:
    """mlx-lm's ``TextStateMachine`` state for stop strings (empty strings ignored): feed it the
    detokenized text with ``TextStateMachine.step``; the state's name turns None at the first
    stop string (the text before it is emitted, the stop string is not), and text that may be
    the start of a stop string is held back until it is known not to be."""
    return TextStateMachine({"normal": [(s, None) for s in stop if s]}).make_state()


def stream_generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: str | Sequence[int] | mx.array,
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    repetition_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    prompt_cache: list[Any] | None = None,
    max_kv_size: int | None = None,
    prefill_step_size: int = 2048,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    draft_model: nn.Module | None = None,
    draft_tokenizer: TokenizerWrapper | None = None,
    num_draft_tokens: int | str = "auto",
    prompt_lookup: bool = False,
    ngram_max: int = 3,
    draft_min_confidence: float = 0.0,
    draft: Drafter | None = None,
) -> Iterator[Response]:
    """Stream a completion, one ``Response`` per token (the last one has ``finish_reason``).

    Args:
        prompt: text (BOS added if the tokenizer wants it) or token ids.
        max_tokens: the most tokens to generate (a whole number >= 1).
        temp, top_p, top_k, min_p: sampling; ``temp=0`` is greedy (see ``SamplingParams``).
        seed: reproducible sampling: the token at each absolute position is drawn with a key
            derived from the seed and the position, so the same seed gives the same text with or
            without speculation, whatever draft length is chosen. None: MLX's global RNG.
        stop: strings that end generation (not included in the output).
        repetition_penalty, logit_bias, logits_processors: logits processors (mlx-lm's).
        prompt_cache: a cache from ``mlxspec.cache.make_cache`` holding a prefix of the
            conversation; ``prompt`` is then only the new tokens. Updated in place.
        max_kv_size: bound the KV cache to this many tokens (a sliding window, every layer) when
            ``prompt_cache`` is not given. Without it, prompt + max_tokens must fit the model's
            context (``max_position_embeddings``).
        prefill_step_size: the most prompt tokens per prefill forward (chunks also stay under
            about a second, so Ctrl-C stops a long prefill promptly).
        kv_bits, kv_group_size, quantized_kv_start: quantize the KV cache (mlx-lm's
            ``QuantizedKVCache``) once it holds ``quantized_kv_start`` tokens.
        prompt_progress_callback: called with ``(processed, total)`` prompt tokens.
        draft_model / prompt_lookup / draft: speculative decoding with a draft model sharing the
            tokenizer, with prompt lookup, or with a ready drafter object.
        draft_tokenizer: the draft model's tokenizer, checked against ``tokenizer``
            (``mlxspec.errors.TokenizerMismatchError``).
        num_draft_tokens: draft length per pass, or ``"auto"`` to adapt it.
        draft_min_confidence: a draft model stops drafting below this top probability.

    Raises:
        InvalidArgumentError: an argument is out of range (before any work is done).
    """
    sampling = SamplingParams(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    check_seed(seed)
    check_generation_arguments(
        max_tokens=max_tokens, num_draft_tokens=num_draft_tokens,
        prefill_step_size=prefill_step_size, kv_bits=kv_bits, kv_group_size=kv_group_size,
        max_kv_size=max_kv_size, min_confidence=draft_min_confidence,
    )
    prompt_ids = encode_prompt(tokenizer, prompt, model)
    if prompt_cache is None:
        prompt_cache = make_cache(model, max_kv_size)
    windowed = [isinstance(c, (RotatingKVCache, WindowKVCache)) for c in prompt_cache]
    if not all(windowed):  # some layer keeps every token: the whole text must fit the context
        check_context(model, cache_offset(prompt_cache), prompt_ids.size, max_tokens)
    if kv_bits is not None and any(windowed):
        raise InvalidArgumentError(
            "kv_bits needs a cache without sliding-window layers (mlx-lm cannot quantize a "
            "rotating cache): drop kv_bits or max_kv_size"
        )
    processors = list(logits_processors or []) + make_logits_processors(
        logit_bias, repetition_penalty
    )
    if draft is None and (draft_model is not None or prompt_lookup):
        draft = make_drafter(
            tokenizer, model, draft_model=draft_model, draft_tokenizer=draft_tokenizer,
            prompt_lookup=prompt_lookup, ngram_max=ngram_max, max_kv_size=max_kv_size,
            min_confidence=draft_min_confidence,
        )
    spec_stats = SpecStats() if draft is not None else None

    tic = time.perf_counter()
    prefill_end: float | None = None

    def progress(done: int, total: int) -> None:
        nonlocal prefill_end
        if done == total:
            prefill_end = time.perf_counter()
        if prompt_progress_callback is not None:
            prompt_progress_callback(done, total)

    tokens = token_generator(
        prompt_ids, model, sampling=sampling, max_tokens=max_tokens, prompt_cache=prompt_cache,
        logits_processors=processors or None, draft=draft, num_draft_tokens=num_draft_tokens,
        spec_stats=spec_stats, seed=seed, prefill_step_size=prefill_step_size, kv_bits=kv_bits,
        kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
        prompt_progress_callback=progress,
    )
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    stop_state = stop_text_state(stop)
    eos_ids = set(tokenizer.eos_token_ids)
    n = 0
    finish_reason = "length"
    token, logprobs, from_draft = -1, None, False

    def response(text: str, reason: str | None) -> Response:
        start = prefill_end if prefill_end is not None else tic
        prefill_seconds = max(start - tic, 1e-9)
        return Response(
            text=text, token=token, logprobs=logprobs, from_draft=from_draft,
            prompt_tokens=prompt_ids.size, prompt_tps=prompt_ids.size / prefill_seconds,
            generation_tokens=n, generation_tps=n / max(time.perf_counter() - start, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=reason, spec_stats=spec_stats,
        )

    stopped = False
    final_text = ""
    with wired_limit(model, [generation_stream]):
        for token, logprobs, from_draft in tokens:  # noqa: B007 (read by response())
            n += 1
            if token in eos_ids:
                finish_reason = "stop"
                break
            detokenizer.add_token(token)
            stop_state, text, name = TextStateMachine.step(stop_state, detokenizer.last_segment)
            stopped = name is None
            if stopped or n == max_tokens:
                final_text = text
                break
            yield response(text, None)
        tokens.close()
    if not stopped:
        detokenizer.finalize()
        stop_state, text, name = TextStateMachine.step(stop_state, detokenizer.last_segment)
        stopped = name is None
        final_text += text if stopped else text + TextStateMachine.flush(stop_state)[1]
    if stopped:
        finish_reason = "stop"
    yield response(final_text, finish_reason)


def generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: str | Sequence[int] | mx.array,
    **kwargs: Any,
) -> str:
    """The whole completion as one string; takes ``stream_generate``'s keyword arguments."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))
