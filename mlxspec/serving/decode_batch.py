"""The running batch under ``mlxspec.serving.engine.Engine``: mlx-lm's ``GenerationBatch`` for the decode
steps, with each arriving prompt prefilled here, a chunk per step.

mlx-lm's ``BatchGenerator`` prefills a prompt without its last token and then runs that token in
a forward of its own (the new row's first step) before the row joins the batch: two forwards per
arrival, each stalling every running stream. Here the prompt's last token is part of its last
prefill chunk, the first token is sampled from that chunk's logits, and the row joins the batch
in the state mlx-lm's first step leaves it in (that token drawn, emitted by the next batched
step): one forward per group of prompts arriving together, and their first tokens a step
sooner. (SmolLM2 on 2 CPU cores: the saved forward is ~60 ms; 8 in-process clients sending
64-token requests back to back, 74.2 against 72.6 tokens/s, two runs each, interleaved.) A row
with a single prompt token left (its prompt found whole in the prefix cache, a stream back from
speculative decoding) needs no forward of its own: the next batched step feeds that token
(``DecodeBatch._join_in_step``; 8 in-process clients drawing from 16 chat prompts, 103.4
against 97.4 tokens/s, two runs each, interleaved). Prompts that fit, with the running rows,
in ``mlxspec.serving.fused_prefill.MAX_FUSED_ROWS`` rows are prefilled inside the running rows' decode
step instead, sharing its weight products (``mlxspec.serving.fused_prefill``; the same numbers): 8 rows
and a 13-token prompt 92.6 against 109.1 ms for the step and the prefill apart; ``mlxspec
serve`` with 8 clients, 105.9 and 103.6 against 102.2 and 100.3 tokens/s, runs in turns). A row
leaving is retired in place and the
next row to join takes its slot, and greedy rows skip the per-step normalization
(``mlxspec.serving.rows.BatchRows``).

Nothing else changes: decoding, sampling, logits processors, stop tokens, token counts and the
caches handed out are mlx-lm's own.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch, StopSequences, generation_stream
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.sample_utils import greedy_sampler

from mlxspec.cache import make_cache
from mlxspec.serving import wired
from mlxspec.serving.fused_prefill import MAX_FUSED_ROWS, Part, WithPrefill
from mlxspec.serving.rows import RETIRED, BatchRows

CLEAR_EVERY = 512  # decode steps between releases of MLX's buffer cache (as mlx-lm's batching)
# Positions a batch's KV cache grows by (mlx-lm: 256). 8 in-process clients drawing from 16 chat
# prompts (answers <= 64 tokens): 110.6 tok/s at 64 against 104.5 at 256, 2 runs each, in turns.
KV_STEP = 64
JOIN_IN_STEP = True  # False: a row with one prompt token left gets a forward of its own (A/B runs)
FUSE_PREFILL = True  # False: joining prompts always get a forward of their own (A/B runs)


@dataclass
class _Pending:
    """A row still prefilling: ``rest`` is what its cache does not hold yet."""

    uid: int
    rest: list[int]
    cache: list[Any]
    tokens: list[int]  # what the cache holds
    max_tokens: int
    sampler: Any
    processors: list[Any]


def _merged_caches(rows: list[_Pending]) -> list[Any]:
    """The rows' caches merged into batch caches (mlx-lm's ``merge``), growing in steps of
    ``KV_STEP`` positions.

    A row joining or leaving the batch copies every batch cache whole (``extend``, ``filter``),
    allocated positions included: mlx-lm's 256-position steps make a 100-token batch of 8 rows
    copy 2.5x what it holds, ~22 ms a join or a leave for SmolLM2 here."""
    caches = [layer.merge([row.cache[i] for row in rows]) for i, layer in enumerate(rows[0].cache)]
    for c in caches:
        if isinstance(c, BatchKVCache):
            c.step = KV_STEP
    return caches


class _FirstStepDone(GenerationBatch):
    """New rows of a ``GenerationBatch`` constructed without running a step (``_step`` is what
    the constructor calls): rows whose first step the prefill already did, or rows whose last
    prompt token the next batched step feeds (``DecodeBatch._join_in_step``)."""

    def _step(self):  # only the constructor reaches this class's step
        return [], []


class _GatherThenNorm(nn.Module):
    """A model's final norm applied to one position per row (``positions``): the output head
    after it then runs on those positions only."""

    def __init__(self, norm: nn.Module, positions: mx.array):
        super().__init__()
        self.norm = norm
        self.positions = positions

    def __call__(self, h: mx.array) -> mx.array:
        return self.norm(h[mx.arange(h.shape[0]), self.positions][:, None])


def last_token_logits(
    model: nn.Module, tokens: mx.array, cache: list[Any], lengths: list[int]
) -> mx.array:
    """The forward of ``tokens`` (rows, length) through ``cache``, returning only the logits at
    each row's last token, position ``lengths[i] - 1``: (rows, vocabulary).

    The output head runs on those positions only (a prompt's other logits are never used; for
    SmolLM2 the head is a fifth of a prefill's work, and 512 tokens' logits would take 100 MB):
    the model's final norm, mlx-lm's ``model.model.norm``, is swapped for one that keeps those
    positions for the forward. A model without one gets the full forward, then the gather.
    """
    positions = mx.array(lengths) - 1
    inner = model.get("model") if isinstance(model, nn.Module) else None
    norm = inner.get("norm") if isinstance(inner, nn.Module) else None
    if not isinstance(norm, nn.Module):
        return model(tokens, cache=cache)[mx.arange(len(lengths)), positions]
    inner.norm = _GatherThenNorm(norm, positions)
    try:
        logits = model(tokens, cache=cache)
    finally:
        inner.norm = norm
    return logits[:, -1]


class DecodeBatch:
    """Rows decoding together, and a queue of prompts prefilling into it.

    Prompts arriving together are prefilled together (in the decode step's forward when they
    fit, else one forward for all of them), a long one in chunks of ``prefill_step`` tokens, one
    chunk per step.

    Args:
        model: the target model.
        eos_token_ids: tokens that end a row (``finish_reason == "stop"``).
        max_batch: the most rows decoding at once; more prompts wait in the queue.
        prefill_step: prompt tokens per step at most (a long prompt is prefilled over several
            steps, the running rows decoding in between).
    """

    def __init__(self, model: nn.Module, eos_token_ids, *, max_batch: int, prefill_step: int):
        self.model = model
        self.max_batch = max_batch
        self.prefill_step = prefill_step
        self.stop = StopSequences([[t] for t in eos_token_ids])
        self._eos = set(eos_token_ids)
        self._in_step: set[int] = set()  # rows whose next response echoes a prompt token
        self.rows = BatchRows.empty(WithPrefill(model), greedy_sampler)
        self.rows.logprob_uids = self._logprob_uids = set()
        self.pending: deque[_Pending] = deque()
        self._uids = itertools.count()
        self._steps = 0
        wired.hold()  # process-wide, restored when the last engine closes
        self._holds_wired_limit = True

    def insert(
        self,
        rest: list[int],
        *,
        cache: list[Any] | None,
        tokens: list[int],
        max_tokens: int,
        sampler: Any,
        processors: list[Any],
        logprobs: bool = False,
    ) -> int:
        """Queue a row: ``rest`` (non-empty) is to be prefilled on top of ``cache`` (None: a new
        one), which holds ``tokens``. ``logprobs``: its responses carry log-probabilities (a
        greedy row without them may get ``None``). Returns the row's id."""
        uid = next(self._uids)
        if logprobs:
            self._logprob_uids.add(uid)
        cache = make_cache(self.model) if cache is None else cache
        self.pending.append(
            _Pending(uid, list(rest), cache, list(tokens), max_tokens, sampler, list(processors)))
        return uid

    def remove(self, uid: int) -> list[Any] | None:
        """Drop a row; returns its cache (holding the tokens emitted so far), None if unknown."""
        self._logprob_uids.discard(uid)
        self._in_step.discard(uid)
        for i, p in enumerate(self.pending):
            if p.uid == uid:
                del self.pending[i]
                return p.cache
        if uid not in self.rows.uids:
            return None
        index = self.rows.uids.index(uid)
        cache = self.rows.extract_cache(index)
        self.rows.filter([i for i in range(len(self.rows)) if i != index])
        return cache

    def next(self) -> list[GenerationBatch.Response]:
        """One decode step of the running rows, then up to ``prefill_step`` prompt tokens of the
        queue; returns the rows' new tokens (mlx-lm's responses)."""
        with mx.stream(generation_stream):
            fused = self._queue_fused_prefill()
            try:
                responses = self.rows.next() if len(self.rows) else []
            except BaseException:
                self.rows.model.discard()
                raise
            if fused is not None:
                self._join(*fused, logits=self.rows.model.take())
            responses = [r for r in responses if r.uid != RETIRED]
            if self._in_step:  # rows that joined in this step: their response is a prompt token
                echoes = self._in_step.intersection(r.uid for r in responses)
                self._in_step -= echoes
                responses = [r for r in responses if r.uid not in echoes]
            for r in responses:
                if r.finish_reason is not None:
                    self._logprob_uids.discard(r.uid)
            self._steps += 1
            if self._steps % CLEAR_EVERY == 0:
                mx.clear_cache()
            self._prefill()
        return responses

    def close(self) -> None:
        if self._holds_wired_limit:
            self._holds_wired_limit = False
            wired.release()

    def _prefill(self) -> None:
        """Prompts whose rest fits in this step's budget are prefilled together (one forward,
        right-padded as mlx-lm's batching pads them) and join the batch; a longer one at the
        head of the queue gets one chunk of its own instead."""
        budget, room = self.prefill_step, self.max_batch - self.rows.live()
        group: list[_Pending] = []
        in_step: list[_Pending] = []
        while self.pending and len(group) + len(in_step) < room:
            row = self.pending[0]
            if self._joins_in_step(row):
                in_step.append(self.pending.popleft())
                continue
            if len(row.rest) > budget:
                if not group:
                    chunk, row.rest = row.rest[:budget], row.rest[budget:]
                    self.model(mx.array(chunk)[None], cache=row.cache)
                    mx.eval([c.state for c in row.cache])
                    row.tokens += chunk
                break
            budget -= len(row.rest)
            group.append(self.pending.popleft())
        if in_step:
            self._join_in_step(in_step)
        if group:
            self._join(group)

    def _join_in_step(self, rows: list[_Pending]) -> None:
        """Rows with one prompt token left on a cache holding the rest (a prompt found whole in
        the prefix cache, a stream back from speculation) join without a forward of their own:
        the next batched step feeds that token with the others' and samples their first token,
        and the response it gives for them, that prompt token, is dropped (``next``). A joining
        row otherwise costs every running row a forward (SmolLM2 on 2 CPU cores: ~45 ms against
        ~5 ms more for one more row in the step); its first token comes from the same number of
        forwards either way, since a step emits the token the step before it drew."""
        cache = _merged_caches(rows)
        joining = _FirstStepDone(
            self.model,
            [row.uid for row in rows],
            mx.array([row.rest[0] for row in rows], mx.uint32),
            cache,
            [row.tokens for row in rows],  # the step appends the fed token
            [row.sampler for row in rows],
            greedy_sampler,
            [tuple(row.processors) for row in rows],
            [self.stop] * len(rows),
            [row.max_tokens for row in rows],
        )
        joining._num_tokens = [-1] * len(rows)  # the echo is not a generated token
        joining._next_logprobs = [None] * len(rows)
        self._in_step.update(row.uid for row in rows)
        self.rows.extend(joining)

    def _joins_in_step(self, row: _Pending) -> bool:
        """Whether ``row`` joins the next batched step with no prefill (``_join_in_step``): one
        prompt token left, not an end token, on a cache holding the rest."""
        return JOIN_IN_STEP and len(row.rest) == 1 and bool(row.tokens) and row.rest[0] not in self._eos

    def _queue_fused_prefill(self) -> tuple[list[_Pending], list[Any], bool] | None:
        """Prompts at the head of the queue that fit in this step's budget and, with the running
        rows, in ``MAX_FUSED_ROWS`` rows of weight products: queued to run in the decode step's
        forward (``mlxspec.serving.fused_prefill``) instead of a forward of their own. Returns what
        ``_join`` needs after the step, or None."""
        if not (FUSE_PREFILL and len(self.rows) and self.rows.model.supported):
            return None
        budget, room = self.prefill_step, self.max_batch - self.rows.live()
        count, longest, total = 0, 0, 0
        for row in self.pending:
            if count == room or self._joins_in_step(row):
                break
            longest, total = max(longest, len(row.rest)), total + len(row.rest)
            if total > budget or len(self.rows.uids) + (count + 1) * longest > MAX_FUSED_ROWS:
                break
            count += 1
        if not count:
            return None
        group = [self.pending.popleft() for _ in range(count)]
        tokens, cache, lengths, padded = self._prefill_inputs(group)
        self.rows.model.queue(Part(tokens, cache, [n - 1 for n in lengths]))
        return group, cache, padded

    def _prefill_inputs(self, group: list[_Pending]) -> tuple[mx.array, list[Any], list[int], bool]:
        """The rows' rests right-padded into one array, their caches merged (and prepared for
        the padding, mlx-lm's way): tokens, caches, lengths, whether padded."""
        lengths = [len(row.rest) for row in group]
        padding = [max(lengths) - n for n in lengths]
        cache = _merged_caches(group)
        if any(padding):
            for c in cache:
                c.prepare(lengths=lengths, right_padding=padding)
        tokens = mx.array([row.rest + [0] * pad for row, pad in zip(group, padding, strict=True)])
        return tokens, cache, lengths, any(padding)

    def _join(self, group: list[_Pending], cache: list[Any] | None = None, padded: bool = False,
              logits: mx.array | None = None) -> None:
        """Prefill the rows' rests in one forward (or take the ``logits`` the decode step's
        forward computed for them on ``cache``), sample each row's first token from the logits
        of its prompt's last token (as mlx-lm's first step would) and add the rows to the batch
        with those tokens pending."""
        if logits is None:
            tokens, cache, lengths, padded = self._prefill_inputs(group)
            logits = last_token_logits(self.model, tokens, cache, lengths)  # (rows, vocabulary)
        if padded:
            for c in cache:
                c.finalize()
        rows_logits = []
        for i, row in enumerate(group):
            row.tokens += row.rest
            row_logits = logits[i : i + 1]
            if row.processors:
                context = mx.array(row.tokens)
                for processor in row.processors:
                    row_logits = processor(context, row_logits)
            rows_logits.append(row_logits)
        logits = mx.concatenate(rows_logits) if len(group) > 1 else rows_logits[0]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [row.sampler for row in group]
        if all(s is samplers[0] for s in samplers):
            first = samplers[0](logprobs)
        else:
            first = mx.concatenate([s(logprobs[i : i + 1]) for i, s in enumerate(samplers)])
        joining = _FirstStepDone(
            self.model,
            [row.uid for row in group],
            first,
            cache,
            [row.tokens for row in group],
            samplers,
            greedy_sampler,
            [tuple(row.processors) for row in group],
            [self.stop] * len(group),
            [row.max_tokens for row in group],
        )
        joining._next_logprobs = list(logprobs)  # the drawn tokens', reported when emitted
        mx.async_eval(first, logprobs)
        self.rows.extend(joining)
