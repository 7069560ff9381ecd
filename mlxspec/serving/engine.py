"""Continuous batching over mlx-lm's ``GenerationBatch``, with speculative decoding for a lone stream.

``Engine`` is the single-threaded core under :mod:`mlxspec.serving.batch` and ``.http``: requests join
(``submit``) and leave (``cancel`` or finishing) between decode steps; each ``step()`` returns the new
tokens as ``Event`` objects. It reads the room:

- two or more streams: one batched forward per step (``decode_batch.DecodeBatch``: mlx-lm's
  ``GenerationBatch``, arriving prompts prefilled in chunks of ``prefill_step`` tokens);
- exactly one stream and a drafter configured: the stream leaves the batch and continues with
  speculative decoding (``mlxspec.generate.token_generator``, auto draft length), as long as its
  measured rate beats the measured rate of plain batched decoding of one stream. A second request
  moves it back into the batch before the next step.

Moving a stream never changes its output: its KV cache moves with it, trimmed so that it holds the
context except the last token, which is fed again (greedy: the same tokens as a plain
single-stream run; sampling: the token drawn but not yet emitted is discarded, the next one drawn
afresh from the same distribution).

Prefix reuse: finished streams leave their KV cache in mlx-lm's ``LRUPromptCache``; a new request
starts from the longest cached prefix of its prompt. ``share_prefix`` prefills a prefix known to
be shared (a batch job's chat template and system prompt, few-shot examples) once, for every
request that starts with it.
"""

from __future__ import annotations

import copy
import itertools
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import TextStateMachine, generation_stream
from mlx_lm.models.cache import LRUPromptCache, RotatingKVCache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlxspec.cache import make_cache, trim_cache
from mlxspec.generate import stop_text_state, token_generator
from mlxspec.sampling import SamplingParams
from mlxspec.serving.decode_batch import DecodeBatch
from mlxspec.serving.requests import Event, Request, request_processors, solo_safe

EMA = 0.2  # weight of the newest measurement in the rate averages
MIN_SOLO_TOKENS = 4  # a stream this close to its end stays where it is
RETRY_EVERY = 64  # tokens of plain decoding before speculation is tried again after losing


@dataclass
class _Stream:
    rid: int
    request: Request
    detokenizer: Any
    text_state: Any
    processors: list[Any]
    tokens: list[int] = field(default_factory=list)  # prompt + generated: the whole context
    generated: int = 0
    cached_tokens: int = 0
    buid: int | None = None  # its row id in the DecodeBatch, None while it decodes alone


@dataclass
class _Solo:
    stream: _Stream
    cache: list[Any]
    tokens: Any  # the token generator


class Rate:
    """Tokens per second from a moving average of seconds per token (a speculative step's
    tokens arrive together: the first carries the step's time, the others none); ``seconds``:
    that average (None before the first measurement)."""

    def __init__(self) -> None:
        self.seconds: float | None = None

    def add(self, tokens: int, seconds: float) -> None:
        per_token = seconds / max(tokens, 1)
        self.seconds = per_token if self.seconds is None else (
            (1 - EMA) * self.seconds + EMA * per_token)

    @property
    def value(self) -> float | None:
        return None if self.seconds is None else 1.0 / max(self.seconds, 1e-9)


class Engine:
    """Continuous batching with speculation when one stream is alone (see the module docstring).

    Args:
        model, tokenizer: the target model (mlxspec.load.load).
        max_batch: the most streams decoded together; more requests wait in the batch queue.
        prefill_step: prompt tokens per step at most (a long prompt is prefilled in chunks of
            this many tokens, with decode steps of the others in between).
        draft: a drafter (``mlxspec.serving.engine.make_draft``) or ``None`` for no speculation.
        num_draft_tokens: draft length, or ``"auto"``.
        prompt_cache_size, prompt_cache_bytes: bounds of the cross-request prefix cache
            (``prompt_cache_size=0`` turns prefix reuse off).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        *,
        max_batch: int = 32,
        prefill_step: int = 512,
        draft: Any = None,
        num_draft_tokens: int | str = "auto",
        prompt_cache_size: int = 8,
        prompt_cache_bytes: int = 1 << 30,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        # The hand-over between the batch and the lone speculative stream trims the KV cache by
        # one token; a sliding-window cache cannot be trimmed once it has wrapped, so a model
        # with one (Gemma-2/3) decodes in the batch only.
        windowed = any(isinstance(c, RotatingKVCache) for c in make_cache(model))
        if windowed and draft is not None:
            warnings.warn("this model has sliding-window layers: serving without speculation "
                          "(its KV cache cannot step back once the window wraps)", stacklevel=2)
        self.draft = None if windowed else draft
        self.num_draft_tokens = num_draft_tokens
        self.batch = DecodeBatch(model, tokenizer.eos_token_ids, max_batch=max_batch,
                                 prefill_step=prefill_step)
        self.prompt_cache = (
            LRUPromptCache(prompt_cache_size, prompt_cache_bytes) if prompt_cache_size > 0 else None
        )
        self.streams: dict[int, _Stream] = {}
        self._by_buid: dict[int, _Stream] = {}
        self._solo: _Solo | None = None
        self._ids = itertools.count()
        self._samplers: dict[SamplingParams, Any] = {}
        self.solo_rate, self.plain_rate = Rate(), Rate()  # one stream: speculative vs batched
        self._plain_since_loss = 0
        self.tokens_generated = 0
        self.peak_streams = 0  # the most streams active at once (a statistic)
        self._shared: tuple[list[int], list[Any]] | None = None  # share_prefix's tokens, cache

    # -- requests joining and leaving ----------------------------------------------------------

    def share_prefix(self, tokens: list[int]) -> None:
        """Prefill ``tokens`` once and keep their KV cache: a request whose prompt starts with
        them starts from a copy and prefills only the rest (unless a cached conversation shares
        more of it). Replaces any earlier shared prefix; an empty one drops it."""
        if not tokens:
            self._shared = None
            return
        cache = make_cache(self.model)
        step = self.batch.prefill_step
        with mx.stream(generation_stream):
            for start in range(0, len(tokens), step):
                # Only the caches are evaluated: the logits (lazy) are never computed.
                self.model(mx.array(tokens[start : start + step])[None], cache=cache)
                mx.eval([c.state for c in cache])
        self._shared = (list(tokens), cache)

    def submit(self, request: Request) -> int:
        """Queue a request; it joins the batch at the next step. Returns its id."""
        if not request.prompt:
            raise ValueError("the prompt is empty")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if request.seed is not None:
            mx.random.seed(request.seed)
        stream = _Stream(
            rid=next(self._ids),
            request=request,
            detokenizer=self.tokenizer.detokenizer,
            text_state=stop_text_state(request.stop),
            processors=request_processors(request, self.tokenizer),
            tokens=list(request.prompt),
        )
        cache, rest = None, list(request.prompt)
        if self.prompt_cache is not None:
            cache, rest = self.prompt_cache.fetch_nearest_cache(id(self.model), rest)
        if self._shared is not None:
            shared, shared_cache = self._shared
            longer = len(request.prompt) - len(rest) < len(shared)
            if longer and request.prompt[: len(shared)] == shared:
                cache, rest = copy.deepcopy(shared_cache), request.prompt[len(shared) :]
        if cache is not None and not rest:  # all cached: feed the last prompt token again
            if trim_cache(cache, 1):
                rest = request.prompt[-1:]
            else:  # a cache that cannot step back (a wrapped window): prefill afresh
                cache, rest = None, list(request.prompt)
        stream.cached_tokens = len(request.prompt) - len(rest)
        self.streams[stream.rid] = stream
        self.peak_streams = max(self.peak_streams, len(self.streams))
        self._to_batch(stream, rest, cache)
        return stream.rid

    def cancel(self, rid: int) -> None:
        """Drop a request at once (its client went away); its slot is free for the next step."""
        stream = self.streams.pop(rid, None)
        if stream is None:
            return
        if self._solo is not None and self._solo.stream is stream:
            self._solo.tokens.close()
            self._solo = None
        elif stream.buid is not None:
            self.batch.remove(stream.buid)
            self._by_buid.pop(stream.buid, None)

    @property
    def speculating(self) -> bool:
        """Whether the lone stream is decoding speculatively right now."""
        return self._solo is not None

    def close(self) -> None:
        for rid in list(self.streams):
            self.cancel(rid)
        self.batch.close()

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Advance every active stream by one token (a lone speculative stream: its next token,
        the rest of an accepted draft following in the next calls at no cost); returns the new
        events, a finished stream's last."""
        if self._solo is not None and len(self.streams) > 1:
            self._solo_to_batch()
        elif self._solo is None and self._wants_solo():
            self._batch_to_solo(next(iter(self.streams.values())))
        if self._solo is not None:
            return self._solo_step()
        if not self.streams:
            return []
        alone = len(self.streams) == 1 and next(iter(self.streams.values())).generated > 0
        tic = time.perf_counter()
        responses = self.batch.next()
        if alone and len(responses) == 1:
            self.plain_rate.add(1, time.perf_counter() - tic)
            self._plain_since_loss += 1
        events = []
        for r in responses:
            stream = self._by_buid.get(r.uid)
            if stream is None:
                continue
            logprobs = r.logprobs if stream.request.logprobs else None
            event = self._emit(stream, r.token, logprobs, r.finish_reason, speculative=False)
            if event.finish_reason is not None:
                self._by_buid.pop(r.uid, None)
                if r.finish_reason is None:  # a stop string: the batch still holds the stream
                    self.batch.remove(r.uid)
                elif r.prompt_cache is not None:
                    self._remember(r.all_tokens, r.prompt_cache)
            events.append(event)
        return events

    # -- the lone stream: speculative decoding ---------------------------------------------------

    def _wants_solo(self) -> bool:
        if self.draft is None or len(self.streams) != 1:
            return False
        stream = next(iter(self.streams.values()))
        request = stream.request
        if stream.generated == 0 or not solo_safe(stream.processors) or request.seed is not None:
            # still prefilling; mlx-lm's processors need the batch's history (a grammar's do not);
            # a seeded request must not depend on timing (auto-k and this policy measure speed)
            return False
        if request.max_tokens - stream.generated < MIN_SOLO_TOKENS:
            return False
        solo, plain = self.solo_rate.value, self.plain_rate.value
        if solo is None or plain is None or solo >= plain:
            return True
        return self._plain_since_loss >= RETRY_EVERY  # lost last time: try again now and then

    def _batch_to_solo(self, stream: _Stream) -> None:
        cache = self.batch.remove(stream.buid)
        self._by_buid.pop(stream.buid, None)
        stream.buid = None
        held = _trim_to(cache, len(stream.tokens) - 1)
        self.draft.prefix = stream.tokens[:held]
        tokens = token_generator(
            mx.array(stream.tokens[held:], mx.int32),
            self.model,
            sampling=stream.request.sampling,
            max_tokens=stream.request.max_tokens - stream.generated,
            prompt_cache=cache,
            logits_processors=[p.view(held) for p in stream.processors] or None,  # from `held` on
            draft=self.draft,
            num_draft_tokens=self.num_draft_tokens,
        )
        self._solo = _Solo(stream, cache, tokens)
        self._plain_since_loss = 0

    def _solo_to_batch(self) -> None:
        solo, self._solo = self._solo, None
        solo.tokens.close()  # leaves the cache holding at most the emitted tokens
        stream = solo.stream
        held = _trim_to(solo.cache, len(stream.tokens) - 1)
        self._to_batch(stream, stream.tokens[held:], solo.cache)

    def _solo_step(self) -> list[Event]:
        solo = self._solo
        stream = solo.stream
        tic = time.perf_counter()
        token, logprobs, _ = next(solo.tokens)
        self.solo_rate.add(1, time.perf_counter() - tic)
        eos = token in self.tokenizer.eos_token_ids
        done = eos or stream.generated + 1 >= stream.request.max_tokens
        reason = ("stop" if eos else "length") if done else None
        event = self._emit(stream, token, logprobs, reason, speculative=True)
        if event.finish_reason is not None:
            self._solo = None
            solo.tokens.close()
            held = _trim_to(solo.cache, len(stream.tokens) - 1)
            if held is not None:
                self._remember(stream.tokens[:held], solo.cache)
        return [event]

    # -- shared bookkeeping ----------------------------------------------------------------------

    def _to_batch(self, stream: _Stream, rest: list[int], cache: list[Any] | None) -> None:
        request = stream.request
        history = len(stream.tokens) - len(rest)
        stream.buid = self.batch.insert(
            rest,
            cache=cache,
            tokens=stream.tokens[:history],
            max_tokens=request.max_tokens - stream.generated,
            sampler=self._sampler(request.sampling),
            processors=stream.processors,
            logprobs=request.logprobs,
        )
        self._by_buid[stream.buid] = stream

    def _sampler(self, params: SamplingParams) -> Any:
        # One sampler object per setting: the batch samples all rows sharing it in one call.
        if params not in self._samplers:
            self._samplers[params] = params.sampler()
        return self._samplers[params]

    def _emit(
        self,
        stream: _Stream,
        token: int,
        logprobs: mx.array | None,
        finish_reason: str | None,
        *,
        speculative: bool,
    ) -> Event:
        """The event for one new token; detokenizes it and applies the stop strings."""
        eos = finish_reason == "stop" and token in self.tokenizer.eos_token_ids
        stream.generated += 1
        stream.tokens.append(token)
        self.tokens_generated += 1
        text = ""
        if not eos:
            stream.detokenizer.add_token(token)
        if finish_reason is not None:
            stream.detokenizer.finalize()
        state, text, name = TextStateMachine.step(stream.text_state, stream.detokenizer.last_segment)
        if name is None:  # a stop string: the text up to it is the completion
            finish_reason = "stop"
        elif finish_reason is not None:
            state, rest, _ = TextStateMachine.flush(state)
            text += rest
        stream.text_state = state
        event = Event(
            rid=stream.rid,
            text=text,
            token=None if eos else token,
            finish_reason=finish_reason,
            prompt_tokens=len(stream.request.prompt),
            completion_tokens=stream.generated - (1 if eos else 0),
            cached_tokens=stream.cached_tokens,
            speculative=speculative,
        )
        if stream.request.logprobs and logprobs is not None and not eos:
            event.logprob = logprobs[token].item()
            k = min(stream.request.top_logprobs, logprobs.shape[-1])
            if k > 0:
                top = mx.argpartition(-logprobs, k - 1)[:k]
                values = logprobs[top].tolist()
                event.top_logprobs = sorted(zip(top.tolist(), values, strict=True), key=lambda t: -t[1])
        if finish_reason is not None:
            self.streams.pop(stream.rid, None)
        return event

    def _remember(self, tokens: list[int], cache: list[Any]) -> None:
        if self.prompt_cache is not None and tokens:
            # A cache extracted from the batch is a lazy copy: evaluated now, it stops pinning
            # the whole batch's keys and values (GBs under load) while it waits in the LRU.
            mx.eval([c.state for c in cache])
            self.prompt_cache.insert_cache(id(self.model), list(tokens), cache)


def _trim_to(cache: list[Any], length: int) -> int | None:
    """Trim a KV cache to hold at most ``length`` tokens; returns how many it holds, or None when
    it cannot step back that far (a wrapped sliding-window cache)."""
    excess = cache[0].offset - length
    if not trim_cache(cache, excess):
        return None
    return cache[0].offset

