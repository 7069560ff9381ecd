"""Feature drafts: a small head that drafts from the target's own hidden states (EAGLE-3).

``FeatureTarget`` is the target's forward run layer by layer (mlx-lm's own modules, in mlx-lm's
order) so that the pass which verifies a draft also hands out the hidden states the head reads:
no second pass. It keeps them by absolute position, so the rollback of rejected drafts needs
nothing (the next pass overwrites them).

``FeatureDrafter`` follows the drafter interface (``begin``/``extend``/``propose``): before it
drafts, its own one-layer KV cache takes one entry per context position p from (the target's
features at p, token p + 1), all the new ones in one forward; then it chains k steps on its own
outputs. The chain's entries are dropped after every pass (the target's features replace them),
which is the exact rollback. Its proposals go through the same verification as any drafter; the
head scores only its reduced vocabulary, so every other token has q = 0 exactly (-inf logits).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import common_prefix_len

from mlxspec.cache import cache_offset, trim_cache
from mlxspec.errors import UnsupportedModelError
from mlxspec.sampling import (
    gumbel_argmax,
    normalized_logprobs,
    processed_logprobs,
    processed_probs,
    sample,
)
from mlxspec.speculative.drafters import CATCH_UP_IN_STEP, Draft, Drafter, _draft_of
from mlxspec.speculative.eagle3 import Eagle3Head

# Architectures whose mlx-lm forward is embed -> layers(h, mask, cache) -> norm -> head, with one
# causal mask (no sliding windows, no embedding scale): FeatureTarget runs exactly that.
LAYERED = ("llama", "qwen2", "qwen3", "mistral", "mimo")
CHUNK = 512  # context positions per head forward while catching up
CATCH_UP_PROBE = 64  # positions of the longer forward that measures the catch-up cost
BACKFILL_MAX = 4096  # the longest cached context whose features are computed again (one-off)


def inner_model(model: nn.Module) -> nn.Module:
    """The decoder stack (``model.model``) of a supported architecture, else UnsupportedModelError."""
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    inner = getattr(model, "model", None)
    windows = getattr(inner, "swa_idx", None) is not None
    if model_type not in LAYERED or inner is None or windows:
        raise UnsupportedModelError(
            f"feature drafts need a {', '.join(LAYERED)} target without sliding windows "
            f"(this one is {model_type or type(model).__name__})")
    if getattr(inner, "pipeline_size", 1) > 1 and getattr(model, "tapped_forward", None) is None:
        raise UnsupportedModelError(
            f"feature drafts on a pipeline need the llama family's split (mlxspec.distributed); "
            f"this {model_type} target's ranks cannot share their hidden states: use --shard "
            "tensor")
    return inner


def tapped_forward(
    model: nn.Module, inputs: mx.array, cache: list | None, taps: Sequence[int]
) -> tuple[mx.array, mx.array]:
    """The target's logits and its fused taps in one pass.

    Args:
        inputs: (B, T) token ids.
        taps: ids j of the hidden states entering layer j (0: the embedding; j = number of
            layers: the last layer's output before the final norm).

    Returns:
        ``(logits (B, T, vocab), features (B, T, len(taps) * hidden))``, the logits exactly
        ``model(inputs, cache=cache)``; a sharded target (``mlxspec.distributed``) gives the
        features on rank 0 alone, the rank that drafts (None on the others).
    """
    sharded = getattr(model, "tapped_forward", None)
    if sharded is not None:
        return sharded(inputs, cache, taps)
    return layered_forward(model, inputs, cache, taps)


def layered_forward(
    model: nn.Module, inputs: mx.array, cache: list | None, taps: Sequence[int]
) -> tuple[mx.array, mx.array]:
    """:func:`tapped_forward` of a model whose every layer runs in this process."""
    inner = inner_model(model)
    h = inner.embed_tokens(inputs)
    cache = cache if cache is not None else [None] * len(inner.layers)
    mask = create_attention_mask(h, cache[0])
    taken = []
    for i, (layer, c) in enumerate(zip(inner.layers, cache, strict=True)):
        if i in taps:
            taken.append(h)
        h = layer(h, mask, cache=c)
    if len(inner.layers) in taps:
        taken.append(h)
    return head_logits(model, inner.norm(h)), mx.concatenate(taken, axis=-1)


def head_logits(model: nn.Module, h: mx.array) -> mx.array:
    """The target's logits (B, T, vocab) from its final norm's output ``h`` (B, T, hidden)."""
    if getattr(model.args, "tie_word_embeddings", False):
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


class FeatureTarget:
    """A callable like the target model (``model(inputs, cache=cache)``) that records the taps.

    ``features`` (n, width) holds the fused taps of absolute positions ``start .. start + n``
    (the cache offset a call starts at is the position of its first input).
    """

    def __init__(self, model: nn.Module, taps: Sequence[int]):
        inner = inner_model(model)
        if max(taps) > len(inner.layers) or min(taps) < 0:
            raise UnsupportedModelError(
                f"the head taps layers {list(taps)} but the target has {len(inner.layers)}")
        self.model, self.taps = model, list(taps)
        self.start, self.features = 0, None

    def __getattr__(self, name: str) -> Any:  # layers, args, make_cache: the model's
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: list | None = None, **kwargs: Any) -> mx.array:
        offset = cache_offset(cache) if cache else 0
        logits, features = tapped_forward(self.model, inputs, cache, self.taps)
        self.record(offset, features[0])
        return logits

    def record(self, offset: int, features: mx.array) -> None:
        """Keep ``features`` (n, width) as those of positions ``offset ..``; later ones go."""
        end = self.start + (0 if self.features is None else self.features.shape[0])
        if self.features is None or not self.start <= offset <= end:
            self.start, self.features = offset, features
        else:
            self.features = mx.concatenate([self.features[: offset - self.start], features])

    def take(self, start: int, end: int, width: int) -> mx.array:
        """(end - start, width) features of positions ``start .. end``; zeros where none were
        recorded (a cache filled without this forward): the drafts there are poor, never wrong."""
        have = 0 if self.features is None else self.features.shape[0]
        lo, hi = max(start, self.start), min(end, self.start + have)
        if lo >= hi:
            return mx.zeros((end - start, width), mx.float32)
        parts = [self.features[lo - self.start : hi - self.start]]
        if lo > start:
            parts.insert(0, mx.zeros((lo - start, width), parts[0].dtype))
        if hi < end:
            parts.append(mx.zeros((end - hi, width), parts[0].dtype))
        return mx.concatenate(parts) if len(parts) > 1 else parts[0]

    def truncate(self, end: int) -> None:
        """Forget the features of positions from ``end`` on (another sequence's, or stale)."""
        if self.features is not None:
            self.features = self.features[: max(end - self.start, 0)]

    def drop_before(self, position: int) -> None:
        """Forget the features of positions before ``position`` (the drafter has them)."""
        if self.features is not None and position > self.start:
            self.features = self.features[position - self.start :]
            self.start = position


class FeatureDrafter(Drafter):
    """Drafts a chain of k tokens with an EAGLE-3 head reading the target's hidden states.

    Args:
        head: the head (``mlxspec.speculative.eagle3``).
        model: the target; the loop runs it as ``self.target`` (``target_model``).
        vocab_size: width of the target's logits (q is given over it; 0 off the draft vocab).
    """

    name = "eagle-3"

    def __init__(self, head: Eagle3Head, model: nn.Module, *, vocab_size: int):
        super().__init__()
        self.head = head
        self.target = FeatureTarget(model, head.config.taps)
        self.width = len(head.config.taps) * head.config.target_hidden_size
        self.draft_ids = head.draft_ids()
        # Target id -> column of [draft logits, -inf]: ids off the draft vocab read the -inf one.
        index = mx.full((vocab_size,), head.config.draft_vocab_size, mx.int32)
        index[self.draft_ids] = mx.arange(head.config.draft_vocab_size, dtype=mx.int32)
        self.full_index = index
        self.reset_cache()
        self.step_seconds, self.catch_up_seconds = self._measure()

    def target_model(self, model: nn.Module) -> Any:
        if model is not self.target.model:
            raise UnsupportedModelError("this feature draft was built for another target model")
        return self.target

    def reset_cache(self) -> None:
        self.cache = [KVCache()]
        self.cached = 0  # the cache holds entries of context positions 0 .. cached - 1
        self.pending = 0  # chained entries after them (dropped after the pass)

    def reset(self) -> None:
        super().reset()
        self.reset_cache()
        self.target.start, self.target.features = 0, None

    def unseen(self) -> int:
        """Context positions a catch-up forward must process first: none while the first draft
        step takes them in itself (up to ``CATCH_UP_IN_STEP``; ``propose`` reports those as
        part of drafting, so the planner measures and charges them once, as drafting cost)."""
        need = max(len(self.context) - 1 - self.cached, 0)
        return need if need > CATCH_UP_IN_STEP else 0

    def begin(self, context: Sequence[int]) -> None:
        held, self.context = self.context, list(context)
        if cache_offset(self.cache) != self.cached + self.pending:  # interrupted: start over
            self.reset_cache()
            keep = 0
        else:
            # Entry p needs tokens 0 .. p + 1: those shared with the new context stay, but for
            # the last one, recomputed so that drafting starts from its output.
            keep = min(common_prefix_len(held, self.context) - 1, self.cached,
                       len(self.context) - 2)
            keep = max(keep, 0)
            trim_cache(self.cache, cache_offset(self.cache) - keep)
            self.cached, self.pending = keep, 0
        # Features past the shared prefix belong to the old context (or to another stream whose
        # positions the target's cache reused): the target's passes record the new ones.
        self.target.truncate(keep + 1)
        self._backfill(keep)

    def _backfill(self, keep: int) -> None:
        """Features of the positions the target's cache already holds (``prefix``: a chat's
        earlier turns, a server's stream leaving the batch) that no pass of ours recorded: one
        target forward over them without the cache (the cache is left untouched, so the
        verification is unchanged). Beyond BACKFILL_MAX positions they read zeros instead
        (poorer drafts, never a wrong token)."""
        end = len(self.prefix)
        target = self.target
        have = 0 if target.features is None else target.features.shape[0]
        # A sharded target's forward is a collective of every rank, and the drafter runs on
        # rank 0 alone (mlxspec.distributed.drafting): no backfill there.
        sharded = getattr(target.model, "shard_layout", None) is not None
        if (sharded or end <= keep or end > BACKFILL_MAX or self.context[:end] != self.prefix
                or target.start <= keep and target.start + have >= end):
            return
        inputs = mx.array(self.context[:end], mx.uint32)[None]
        _, features = tapped_forward(target.model, inputs, None, target.taps)
        target.record(keep, features[0, keep:])

    def extend(self, tokens: Sequence[int]) -> None:
        trim_cache(self.cache, self.pending)  # the chain's entries: replaced by the target's
        self.pending = 0
        self.context += tokens

    def _catch_up(self) -> tuple[mx.array, int]:
        """Entries for every position not in the cache; the last one's pre-norm output (1, 1, H)."""
        end = len(self.context) - 1
        need = end - self.cached
        out = None
        for lo in range(self.cached, end, CHUNK):
            hi = min(lo + CHUNK, end)
            features = self.target.take(lo, hi, self.width)[None]
            tokens = mx.array(self.context[lo + 1 : hi + 1], mx.uint32)[None]
            out = self.head.step(tokens, features.astype(self.head.dtype), self.cache,
                                 features=True)
        self.cached = end
        self.target.drop_before(end - 1)  # the last entry may be recomputed (``begin``)
        return out[:, -1:], need

    def _full_logits(self, draft_logits: mx.array, fill: float = -mx.inf) -> mx.array:
        """(1, vocab) values over the target's vocabulary from (1, draft_vocab) ones: ``fill``
        off the draft vocabulary (-inf for logits, 0 for probabilities)."""
        pad = mx.full((1, 1), fill, draft_logits.dtype)
        return mx.concatenate([draft_logits, pad], axis=-1)[:, self.full_index]

    def propose(self, k, sampling, logits_processor=None, keys=None) -> Draft:
        if k == 0 or len(self.context) < 2:
            return _draft_of([])
        h, need = self._catch_up()
        drafted = mx.array([], mx.uint32)
        probs = []
        for i in range(k):
            logits = self.head.logits(h[0]).astype(mx.float32)  # (1, draft_vocab)
            if sampling.greedy and logits_processor is None:
                y = self.draft_ids[mx.argmax(logits, axis=-1)].astype(mx.uint32)
            elif logits_processor is None and keys is None:
                # Rejection sampling, no processors: q is 0 off the draft vocabulary, so it is
                # computed and drawn from there alone (4,096 tokens, not 49,152: ~1 ms less a
                # drafted token on a CPU) and reported over the whole vocabulary.
                q = processed_probs(normalized_logprobs(logits), sampling)
                y = self.draft_ids[sample(q)].astype(mx.uint32)
                probs.append(self._full_logits(q, fill=0.0))
            else:
                logits = self._full_logits(logits)
                if logits_processor is not None:  # the target's, with the drafted history
                    logits = logits_processor(drafted, logits)
                # Processors that rule out the whole draft vocabulary: draw from uniform (any q
                # the token is drawn from keeps the verification exact).
                logits = mx.where(mx.max(logits, axis=-1, keepdims=True) == -mx.inf, 0.0, logits)
                logprobs = normalized_logprobs(logits)
                if sampling.greedy:
                    y = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
                elif keys is not None:  # seeded: the Gumbel-max draw with the position's key
                    y = gumbel_argmax(processed_logprobs(logprobs, sampling), keys(i))
                else:  # sampling: draw from the processed draft distribution q and report q
                    q = processed_probs(logprobs, sampling)
                    y = sample(q)
                    probs.append(q)
            drafted = mx.concatenate([drafted, y.reshape(1).astype(mx.uint32)])
            if i + 1 < k:  # chain: the head's own output and the drafted token
                h = self.head.step(y.reshape(1, 1), h, self.cache, features=False)
                self.pending += 1
        probs = mx.concatenate(probs) if probs else None
        return Draft(drafted, probs, caught_up=need if need > CATCH_UP_IN_STEP else 1)

    def _measure(self) -> tuple[float, float]:
        """Seconds of one chained step and of one caught-up position (planner priors).

        A caught-up position costs the slope between a forward over ``CATCH_UP_PROBE`` positions
        and one over ``CATCH_UP_IN_STEP``: the forward's fixed cost is a draft step's, which the
        planner already counts (8 positions' forward over 8 counts it ~4x over per position, and
        the planner then holds back from catching up after a pause, pausing longer each time).
        Floored at an eighth of the long forward's time per position: two timings on a busy
        machine can come out in either order, and a zero prior would make catching up free."""
        head = self.head

        def forward(n: int) -> tuple[float, mx.array, list]:
            features = mx.zeros((1, n, self.width), head.dtype)
            tokens = mx.zeros((1, n), mx.uint32)
            times = []
            for _ in range(3):  # the first run builds the shapes: the fastest of the others
                cache = [KVCache()]
                tic = time.perf_counter()
                out = head.step(tokens, features, cache, features=True)
                mx.eval(head.logits(out[:, -1:]))
                times.append(time.perf_counter() - tic)
            return min(times[1:]), out, cache

        short, out, cache = forward(CATCH_UP_IN_STEP)
        long, _, _ = forward(CATCH_UP_PROBE)
        catch_up = max((long - short) / (CATCH_UP_PROBE - CATCH_UP_IN_STEP),
                       long / CATCH_UP_PROBE / 8)
        step = head.step(mx.zeros((1, 1), mx.uint32), out[:, -1:], cache, features=False)
        mx.eval(self._full_logits(head.logits(step[0]).astype(mx.float32)))  # warm-up
        trim_cache(cache, 1)
        tic = time.perf_counter()
        step = head.step(mx.zeros((1, 1), mx.uint32), out[:, -1:], cache, features=False)
        mx.eval(self._full_logits(head.logits(step[0]).astype(mx.float32)))
        return time.perf_counter() - tic, catch_up
