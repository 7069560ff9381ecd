"""Text generation over mlx-lm's decoding loop, with one place that chooses how tokens are produced.

``stream_generate`` yields mlx-lm ``GenerationResponse`` objects (extended with speculative
statistics); ``generate`` returns the whole text. ``token_generator`` is the single switch between
plain decoding (``mlx_lm.generate.generate_step``) and speculative decoding (``mlxspec.speculative``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse, generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class Response(GenerationResponse):
    """mlx-lm's ``GenerationResponse`` plus what mlxspec adds.

    Attributes (beyond mlx-lm's ``text``, ``token``, ``logprobs``, ``from_draft``,
    ``prompt_tokens``, ``prompt_tps``, ``generation_tokens``, ``generation_tps``,
    ``peak_memory`` (GB), ``finish_reason``):
        spec_stats: speculative decoding statistics so far (``None`` for plain decoding).
    """

    spec_stats: Any = None


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is drawn from the model's distribution. ``temp == 0`` is greedy."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def sampler(self) -> Callable[[mx.array], mx.array]:
        """mlx-lm's sampler for these parameters (takes logprobs (batch, vocab))."""
        top_p = self.top_p if 0.0 < self.top_p < 1.0 else 0.0
        return make_sampler(self.temp, top_p=top_p, min_p=self.min_p, top_k=self.top_k)


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str | Sequence[int] | mx.array) -> mx.array:
    """Token ids (seq,) int32 for a prompt string or ids; adds BOS the way mlx-lm does."""
    if isinstance(prompt, mx.array):
        return prompt
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    return mx.array(list(prompt), dtype=mx.int32)


def token_generator(
    prompt: mx.array,
    model: nn.Module,
    *,
    sampling: SamplingParams,
    max_tokens: int,
    prompt_cache: list[Any] | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    draft: Any = None,
    num_draft_tokens: int | str = "auto",
    spec_stats: Any = None,
) -> Iterator[tuple[int, mx.array | None, bool]]:
    """The one place that chooses how tokens are produced.

    Args:
        prompt: (seq,) int32 token ids not yet in ``prompt_cache``.
        draft: ``None`` for plain decoding, else a drafter from ``mlxspec.speculative``
            (a draft model or prompt lookup).

    Yields:
        ``(token, logprobs (vocab,) or None, from_draft)``.
    """
    if draft is None:
        for token, logprobs in generate_step(
            prompt,
            model,
            max_tokens=max_tokens,
            sampler=sampling.sampler(),
            logits_processors=logits_processors,
            prompt_cache=prompt_cache,
        ):
            yield token, logprobs, False
        return
    from mlxspec.speculative import speculative_generate_step

    yield from speculative_generate_step(
        prompt,
        model,
        draft,
        sampling=sampling,
        max_tokens=max_tokens,
        prompt_cache=prompt_cache,
        logits_processors=logits_processors,
        num_draft_tokens=num_draft_tokens,
        stats=spec_stats,
    )


class _StopMatcher:
    """Holds back streamed text that may be the start of a stop string."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was reached)."""
        self.pending += text
        for s in self.stop:
            at = self.pending.find(s)
            if at >= 0:
                out, self.pending = self.pending[:at], ""
                return out, True
        keep = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


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
    draft_model: nn.Module | None = None,
    draft_tokenizer: TokenizerWrapper | None = None,
    num_draft_tokens: int | str = "auto",
    prompt_lookup: bool = False,
    ngram_max: int = 3,
    draft: Any = None,
) -> Iterator[Response]:
    """Stream a completion, one ``Response`` per token (the last one has ``finish_reason``).

    Args:
        prompt: text (BOS added if the tokenizer wants it) or token ids.
        max_tokens: the most tokens to generate.
        temp, top_p, top_k, min_p: sampling; ``temp=0`` is greedy.
        seed: seeds MLX's random generator for reproducible sampling.
        stop: strings that end generation (not included in the output).
        repetition_penalty, logit_bias, logits_processors: logits processors (mlx-lm's).
        prompt_cache: a cache from ``mlx_lm.models.cache.make_prompt_cache`` holding a prefix of the
            conversation; ``prompt`` is then only the new tokens. Updated in place.
        max_kv_size: a rotating cache of this many tokens when ``prompt_cache`` is not given.
        draft_model / prompt_lookup / draft: speculative decoding with a draft model sharing the
            tokenizer, with prompt lookup, or with a ready drafter object.
        draft_tokenizer: the draft model's tokenizer, checked against ``tokenizer``
            (``mlxspec.errors.TokenizerMismatchError``).
        num_draft_tokens: draft length per step, or ``"auto"`` to adapt it.
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if seed is not None:
        mx.random.seed(seed)
    prompt_ids = encode_prompt(tokenizer, prompt)
    sampling = SamplingParams(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    processors = list(logits_processors or []) + make_logits_processors(
        logit_bias, repetition_penalty
    )
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model, max_kv_size=max_kv_size)

    spec_stats = None
    if draft is None and (draft_model is not None or prompt_lookup):
        from mlxspec.speculative import make_drafter

        draft = make_drafter(
            tokenizer,
            model,
            draft_model=draft_model,
            draft_tokenizer=draft_tokenizer,
            prompt_lookup=prompt_lookup,
            ngram_max=ngram_max,
            max_kv_size=max_kv_size,
        )
    if draft is not None:
        from mlxspec.speculative import SpecStats

        spec_stats = SpecStats()

    tokens = token_generator(
        prompt_ids,
        model,
        sampling=sampling,
        max_tokens=max_tokens,
        prompt_cache=prompt_cache,
        logits_processors=processors or None,
        draft=draft,
        num_draft_tokens=num_draft_tokens,
        spec_stats=spec_stats,
    )
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    stopper = _StopMatcher(stop)
    eos_ids = set(tokenizer.eos_token_ids)

    tic = time.perf_counter()
    prompt_tps = 0.0
    n = 0
    finish_reason = "length"
    token, logprobs, from_draft = -1, None, False

    def response(text: str, reason: str | None) -> Response:
        elapsed = max(time.perf_counter() - tic, 1e-9)
        return Response(
            text=text,
            token=token,
            logprobs=logprobs,
            from_draft=from_draft,
            prompt_tokens=prompt_ids.size,
            prompt_tps=prompt_tps,
            generation_tokens=n,
            generation_tps=n / elapsed,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=reason,
            spec_stats=spec_stats,
        )

    stopped = False
    final_text = ""
    for token, logprobs, from_draft in tokens:  # noqa: B007 (read by response())
        if n == 0:
            prompt_tps = prompt_ids.size / max(time.perf_counter() - tic, 1e-9)
            tic = time.perf_counter()
        n += 1
        if token in eos_ids:
            finish_reason = "stop"
            break
        detokenizer.add_token(token)
        text, stopped = stopper.feed(detokenizer.last_segment)
        if stopped or n == max_tokens:
            final_text = text
            break
        yield response(text, None)
    tokens.close()
    if not stopped:
        detokenizer.finalize()
        text, stopped = stopper.feed(detokenizer.last_segment)
        final_text += text if stopped else text + stopper.flush()
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
