"""The rows of the running batch: mlx-lm's ``GenerationBatch`` with two changes, neither of which
alters a token (``mlxspec.serving.decode_batch.DecodeBatch`` prefills the rows that join).

Rows leaving and joining: mlx-lm copies every KV cache whole for each row that leaves
(``filter``) and each that joins (``extend``), ~11 ms at 8 rows and ~220 ms at 128 for SmolLM2
here. A leaving row is retired in place instead, and the next row to join takes its slot, its keys
and values written right-aligned to the others' (under 1 ms); a 256-prompt text job at 128 rows,
140.8 against 118.3 tokens/s.

Greedy rows skip the normalization: mlx-lm takes the argmax of ``logits - logsumexp(logits)``,
which costs a pass of ``exp`` over the vocabulary per row and step (MLX's CPU ``exp`` is scalar,
~20 ns an element: 63 ms a step at 64 rows). When every row is greedy, has no logits processors
and reports no log-probabilities, the step takes the argmax of the raw logits instead, which is the
same token unless another logit lies within ``GREEDY_TIE`` of the top one (subtracting the same
number rounds monotonically, so only near-ties can merge); those rows are normalized as mlx-lm
does before their token is used (``greedy_tokens``). SmolLM2 on 2 CPU cores, 64 prompts at batch
size 64 (``mlxspec.batch_generate``, runs in turns, ``bench/serve.py``'s ``shortcut`` section,
``bench/results/serve.json``): 274-292 tokens/s against 243-252 without, the same texts.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.sample_utils import greedy_sampler

from mlxspec import cpu
from mlxspec.sampling import is_greedy_sampler

# Logits this close to a row's largest may round to the same log-probability (|logprob| <= log
# of the vocabulary < 16, where float32's spacing is at most 2**-19): such rows are normalized.
GREEDY_TIE = 2.0**-16
GREEDY_SHORTCUT = True  # False: every step normalizes as mlx-lm's (bench/serve.py's "shortcut")
RETIRED = -1  # the uid of a row that left, its slot kept for the next row to join
RETIRE_ROWS = True  # False: a leaving row is filtered out at once, as mlx-lm does (A/B runs)
# Positions at the start of every live row's cache that hold nobody's keys (the rows are
# right-aligned to longer ones that left) from which a leaving row compacts the batch instead of
# retiring: attention runs over them at every step, a compaction costs a copy of the caches and
# the next join another (~5-10 ms each at 8 rows). SmolLM2, 7 short rows after a 2,690-token row
# left: 55 against 243 ms a step; 8 HTTP clients sending short requests: no difference measured.
TRIM_PADDING = 32
_NEVER = StopSequences()  # stops nothing: a retired row's


def greedy_candidates(logits: mx.array) -> tuple[mx.array, mx.array]:
    """Lazily: the argmax of each row of ``logits`` (rows, vocabulary), and how many logits of the
    row lie within ``GREEDY_TIE`` of its largest (1: the argmax is also that of the row's
    log-probabilities; 0 for a row whose largest is not finite, left to the normalization).
    One op where :mod:`mlxspec.cpu.ops` is enabled (the same numbers)."""
    if (single := cpu.greedy_candidates(logits, GREEDY_TIE)) is not None:
        return single
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


def _plain_batch_caches(caches: list) -> bool:
    """Whether rows can be written in place into ``caches``: every layer a plain ``BatchKVCache``
    (no sliding window) holding keys, with no prefill padding pending."""
    return bool(caches) and all(
        type(c) is BatchKVCache and c.keys is not None and c._right_padding is None
        for c in caches)


class BatchRows(GenerationBatch):
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
            and all(is_greedy_sampler(s or self.fallback_sampler) for s in samplers)
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
    # left live, when a joining row's cache is longer than the batch's, or when the live rows'
    # caches all start with ``TRIM_PADDING`` empty positions (mlx-lm's ``filter`` drops them).

    def live(self) -> int:
        """Rows decoding for a request (retired ones not counted)."""
        return sum(uid != RETIRED for uid in self.uids)

    def filter(self, keep: list[int]) -> None:
        gone = sorted(set(range(len(self.uids))).difference(keep))
        retired = len(self.uids) - self.live()
        live_after = len(self.uids) - retired - sum(self.uids[i] != RETIRED for i in gone)
        if (RETIRE_ROWS and keep == sorted(keep) and self._slots_writable() and live_after > 0
                and retired + len(gone) <= max(1, live_after // 4)
                and self._shared_padding(keep) < TRIM_PADDING):
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

    def _shared_padding(self, keep: list[int]) -> int:
        """Positions empty at the start of every kept live row's cache (mlx-lm's ``filter``
        drops them when compacting)."""
        padding = self.prompt_cache[0].left_padding.tolist()
        return min((padding[i] for i in keep if self.uids[i] != RETIRED), default=0)

    def _slots_writable(self) -> bool:
        return _plain_batch_caches(self.prompt_cache)

    def _fits(self, batch: GenerationBatch) -> bool:
        if not (self._slots_writable() and _plain_batch_caches(batch.prompt_cache)):
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
