"""The running batch under ``mlxspec.engine.Engine``: mlx-lm's ``GenerationBatch`` for the decode
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
against 97.4 tokens/s, two runs each, interleaved). A row leaving is retired in place and the
next row to join takes its slot (``_Rows``): mlx-lm copies every KV cache whole for each
(~11 ms at 8 rows, ~220 ms at 128, against under 1 ms for writing a slot); a 256-prompt text job
at 128 rows, 140.8 against 118.3 tokens/s.

Greedy rows skip the normalization: mlx-lm takes the argmax of ``logits - logsumexp(logits)``,
which costs a pass of ``exp`` over the vocabulary per row and step (MLX's CPU ``exp`` is scalar,
~20 ns an element: 63 ms a step at 64 rows). When every row is greedy, has no logits processors
and reports no log-probabilities, the step takes the argmax of the raw logits instead, which is the
same token unless another logit lies within ``GREEDY_TIE`` of the top one (subtracting the same
number rounds monotonically, so only near-ties can merge); those rows are normalized as mlx-lm
does before their token is used (``greedy_tokens``). SmolLM2 on 2 CPU cores, 64 prompts at batch
size 64 (``mlxspec.batch_generate``, runs in turns, ``bench/serve.py``'s ``shortcut`` section):
91-97 tokens/s against 84-91 without (an earlier run: 98-107 against 87-92), the same texts.

Nothing else changes: decoding, sampling, logits processors, stop tokens, token counts and the
caches handed out are mlx-lm's own.
"""

from __future__ import annotations

import itertools
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch, StopSequences, generation_stream
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.utils import maybe_set_recommended_wired_limit

from mlxspec.cache import make_cache

CLEAR_EVERY = 512  # decode steps between releases of MLX's buffer cache (as mlx-lm's batching)
# Logits this close to a row's largest may round to the same log-probability (|logprob| <= log
# of the vocabulary < 16, where float32's spacing is at most 2**-19): such rows are normalized.
GREEDY_TIE = 2.0**-16
RETIRED = -1  # the uid of a row that left, its slot kept for the next row to join (_Rows)
RETIRE_ROWS = True  # False: a leaving row is filtered out at once, as mlx-lm does (A/B runs)
_NEVER = StopSequences()  # stops nothing: a retired row's
GREEDY_SHORTCUT = True  # False: every step normalizes as mlx-lm's (bench/serve.py's "shortcut")
# Positions a batch's KV cache grows by (mlx-lm: 256). 8 in-process clients drawing from 16 chat
# prompts (answers <= 64 tokens): 110.6 tok/s at 64 against 104.5 at 256, 2 runs each, in turns.
KV_STEP = 64
JOIN_IN_STEP = True  # False: a row with one prompt token left gets a forward of its own (A/B runs)


def greedy_candidates(logits: mx.array) -> tuple[mx.array, mx.array]:
    """Lazily: the argmax of each row of ``logits`` (rows, vocabulary), and how many logits of the
    row lie within ``GREEDY_TIE`` of its largest (1: the argmax is also that of the row's
    log-probabilities; 0 for a row whose largest is not finite, left to the normalization)."""
    top = mx.argmax(logits, axis=-1)
    best = mx.take_along_axis(logits, top[:, None], axis=-1)
    near = mx.sum(logits >= best - GREEDY_TIE, axis=-1)
    return top, mx.where(mx.isfinite(best[:, 0]), near, 0)


def greedy_tokens(logits: mx.array, top: mx.array, near: mx.array) -> mx.array:
    """mlx-lm's greedy tokens, ``argmax(logits - logsumexp(logits))`` per row, from
    ``greedy_candidates``: rows with a near-tie are normalized, the others keep ``top``
    (which may go on with rows of its own after those of ``logits``: they are kept)."""
    tied = [i for i, n in enumerate(near.tolist()) if n != 1]
    if not tied:
        return top
    rows = logits[mx.array(tied)]
    exact = mx.argmax(rows - mx.logsumexp(rows, axis=-1, keepdims=True), axis=-1)
    tokens = top.tolist()
    for i, token in zip(tied, exact.tolist(), strict=True):
        tokens[i] = token
    return mx.array(tokens, dtype=top.dtype)


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
    allocated positions included: mlx-lm's 256-position steps made a 100-token batch of 8 rows
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


class _Rows(GenerationBatch):
    """mlx-lm's ``GenerationBatch`` with the greedy shortcut of the module docstring.

    A shortcut step leaves its tokens unchecked (``_check``: the logits and near-tie counts of
    its rows). The next step builds its forward on them at once, as mlx-lm does (the forward
    runs while the caller handles the previous tokens), then checks them: after a near-tie it
    steps the caches back one token and redoes the forward on the normalized tokens. Caches
    that cannot step back (a wrapped sliding window) have the tokens checked first. Rows
    leaving are dropped from the check with their tokens; rows joining are appended after them
    (their first tokens come normalized from the prefill).
    """

    _check: tuple[mx.array, mx.array] | None = None
    logprob_uids: set[int] = frozenset()  # rows reporting log-probabilities (set by DecodeBatch)

    def _step(self):
        if not self._plain_greedy():
            self._settle()
            return super()._step()
        if self._check is not None and not all(c.is_trimmable() for c in self.prompt_cache):
            self._settle()  # caches that cannot step back: check the tokens before the forward
        check, self._check = self._check, None
        inputs = self._next_tokens
        top, near, logits = self._forward(inputs)
        if check is not None:
            settled = greedy_tokens(check[0], inputs, check[1])  # waits for the previous step
            if settled is not inputs:  # a near-tie: that forward was fed another token
                for c in self.prompt_cache:
                    c.trim(1)
                inputs = settled
                top, near, logits = self._forward(inputs)
        self._current_tokens, self._current_logprobs = inputs, self._next_logprobs
        self._next_tokens, self._check = top, (logits, near)
        self._next_logprobs = [None] * len(self.uids)
        tokens = inputs.tolist()
        for row_tokens, token in zip(self.tokens, tokens, strict=True):
            row_tokens.append(token)
        return tokens, self._current_logprobs

    def _forward(self, inputs: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        top, near = greedy_candidates(logits)
        mx.async_eval(top, near)
        return top, near, logits

    def _plain_greedy(self) -> bool:
        samplers = self.samplers or [None] * len(self.uids)
        return (
            GREEDY_SHORTCUT
            and all((s or self.fallback_sampler) is greedy_sampler for s in samplers)
            and not any(self.logits_processors)
            and not any(uid in self.logprob_uids for uid in self.uids)
        )

    def _settle(self) -> None:
        if self._check is not None:
            logits, near = self._check
            self._check = None
            self._next_tokens = greedy_tokens(logits, self._next_tokens, near)

    # -- rows leaving and joining: retired slots, taken by the next rows to join ----------------
    # A row leaving mlx-lm's batch copies every cache whole (``filter``), and so does a row
    # joining (``extend``). A leaving row is retired instead: it stays in the caches, decoding
    # for nobody (its responses carry the uid ``RETIRED``), until a joining row takes its slot,
    # its keys and values written in place, right-aligned to the others'. The batch is compacted
    # (one copy) only when the retired rows outnumber a quarter of the live ones, when none is
    # left live, or when a joining row's cache is longer than the batch's.

    def live(self) -> int:
        """Rows decoding for a request (retired ones not counted)."""
        return sum(uid != RETIRED for uid in self.uids)

    def filter(self, keep: list[int]) -> None:
        gone = sorted(set(range(len(self.uids))).difference(keep))
        retired = len(self.uids) - self.live()
        live_after = len(self.uids) - retired - sum(self.uids[i] != RETIRED for i in gone)
        if (RETIRE_ROWS and keep == sorted(keep) and self._slots_writable() and live_after > 0
                and retired + len(gone) <= max(1, live_after // 4)):
            for i in gone:
                self._retire(i)
            return
        self._compact([i for i in keep if self.uids[i] != RETIRED])

    def extend(self, batch: GenerationBatch) -> None:
        slots = [i for i, uid in enumerate(self.uids) if uid == RETIRED]
        if slots and len(batch.uids) <= len(slots) and self._fits(batch):
            self._place(slots[: len(batch.uids)], batch)
            return
        if slots:
            self._compact([i for i, uid in enumerate(self.uids) if uid != RETIRED])
        super().extend(batch)

    def _slots_writable(self) -> bool:
        return bool(self.prompt_cache) and all(
            type(c) is BatchKVCache and c.keys is not None and c._right_padding is None
            for c in self.prompt_cache)

    def _fits(self, batch: GenerationBatch) -> bool:
        if not (self._slots_writable() and all(type(c) is BatchKVCache and c.keys is not None
                                               for c in batch.prompt_cache)):
            return False
        mine, theirs = self.prompt_cache[0], batch.prompt_cache[0]
        return theirs._idx - min(theirs.left_padding.tolist()) <= mine._idx

    def _retire(self, i: int) -> None:
        self.uids[i] = RETIRED
        self.tokens[i] = []
        # Another row's sampler: the batch keeps sampling all rows in one call (and greedy
        # rows keep the shortcut) whatever the retired row sampled with.
        others = (s for j, (s, uid) in enumerate(zip(self.samplers, self.uids, strict=True))
                  if j != i and uid != RETIRED)
        self.samplers[i] = next(others, greedy_sampler)
        self.logits_processors[i] = ()
        self.max_tokens[i] = sys.maxsize
        self.stop_sequences[i] = _NEVER
        self._matchers[i] = _NEVER.matcher()
        if self._check is not None and i < self._check[1].shape[0]:
            self._check[1][i] = 1  # its token is nobody's: never redo a step for it

    def _place(self, slots: list[int], batch: GenerationBatch) -> None:
        """Rows of ``batch`` into retired ``slots``: caches written in place, state replaced."""
        padding = batch.prompt_cache[0].left_padding.tolist()
        for c, o in zip(self.prompt_cache, batch.prompt_cache, strict=True):
            for j, i in enumerate(slots):
                n = o._idx - padding[j]
                c.keys[i : i + 1, :, c._idx - n : c._idx] = o.keys[j : j + 1, :, padding[j] : o._idx]
                c.values[i : i + 1, :, c._idx - n : c._idx] = o.values[
                    j : j + 1, :, padding[j] : o._idx]
            index = mx.array(slots)
            c.left_padding[index] = c._idx - (o._idx - o.left_padding)
            c.offset[index] = o.offset
        for j, i in enumerate(slots):
            self.uids[i] = batch.uids[j]
            self.tokens[i] = batch.tokens[j]
            self.samplers[i] = batch.samplers[j]
            self.logits_processors[i] = batch.logits_processors[j]
            self.max_tokens[i] = batch.max_tokens[j]
            self.stop_sequences[i] = batch.stop_sequences[j]
            self._token_context[i] = batch._token_context[j]
            self._num_tokens[i] = batch._num_tokens[j]
            self._matchers[i] = batch._matchers[j]
            self._next_logprobs[i] = batch._next_logprobs[j]
        self._next_tokens[mx.array(slots)] = batch._next_tokens
        if self._check is not None:  # a joining row's first token needs no check
            checked = [i for i in slots if i < self._check[1].shape[0]]
            if checked:
                self._check[1][mx.array(checked)] = 1

    def _compact(self, keep: list[int]) -> None:
        """mlx-lm's ``filter`` (one copy of every cache), the check following the rows."""
        if self._check is not None:
            # The check covers the first rows; rows that joined since are appended after them.
            checked = self._check[1].shape[0]
            if keep != sorted(keep):
                self._settle()
            else:
                rows = [i for i in keep if i < checked]
                index = mx.array(rows, mx.int32)
                self._check = tuple(a[index] for a in self._check) if rows else None
        super().filter(keep)


class DecodeBatch:
    """Rows decoding together, and a queue of prompts prefilling into it.

    Prompts arriving together are prefilled together (one forward for all of them), a long one
    in chunks of ``prefill_step`` tokens, one chunk per step.

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
        self.rows = _Rows.empty(model, greedy_sampler)
        self.rows.logprob_uids = self._logprob_uids = set()
        self.pending: deque[_Pending] = deque()
        self._uids = itertools.count()
        self._steps = 0
        self._old_wired_limit = maybe_set_recommended_wired_limit()

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
            responses = self.rows.next() if len(self.rows) else []
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
        if self._old_wired_limit is not None:
            mx.synchronize(generation_stream)
            mx.set_wired_limit(self._old_wired_limit)
            self._old_wired_limit = None

    def _prefill(self) -> None:
        """Prompts whose rest fits in this step's budget are prefilled together (one forward,
        right-padded as mlx-lm's batching pads them) and join the batch; a longer one at the
        head of the queue gets one chunk of its own instead."""
        budget, room = self.prefill_step, self.max_batch - self.rows.live()
        group: list[_Pending] = []
        in_step: list[_Pending] = []
        while self.pending and len(group) + len(in_step) < room:
            row = self.pending[0]
            if JOIN_IN_STEP and len(row.rest) == 1 and row.tokens and row.rest[0] not in self._eos:
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

    def _join(self, group: list[_Pending]) -> None:
        """Prefill the rows' rests in one forward, sample each row's first token from the logits
        of its prompt's last token (as mlx-lm's first step would) and add the rows to the batch
        with those tokens pending."""
        lengths = [len(row.rest) for row in group]
        padding = [max(lengths) - n for n in lengths]
        cache = _merged_caches(group)
        if any(padding):
            for c in cache:
                c.prepare(lengths=lengths, right_padding=padding)
        tokens = mx.array([row.rest + [0] * pad for row, pad in zip(group, padding, strict=True)])
        logits = last_token_logits(self.model, tokens, cache, lengths)  # (rows, vocabulary)
        if any(padding):
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
