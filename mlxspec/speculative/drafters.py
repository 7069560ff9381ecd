"""Drafters: what proposes the tokens that speculative decoding verifies.

A drafter proposes up to ``k`` next tokens with the probabilities it drew them from (``None``
means deterministic proposals, q = one-hot). The verifier needs nothing else, so a quantized copy
of the target or a distilled draft plugs in without touching it.

A drafter follows the context incrementally, so a step costs the same at 100 and at 300k tokens:
``begin(context)`` once per generation (it keeps what it shares with the context it held, by
longest common prefix: a new chat turn only costs the new tokens), then ``extend(tokens)`` with
each pass's emitted tokens and ``propose(k, ...)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import common_prefix_len

from mlxspec.cache import (
    cache_offset,
    cannot_roll_back,
    make_cache,
    prefill,
    swap_in_window_caches,
    trim_cache,
)
from mlxspec.sampling import (
    SamplingParams,
    gumbel_argmax,
    normalized_logprobs,
    processed_logprobs,
    processed_probs,
    sample,
)
from mlxspec.speculative.planner import DraftLengthPlanner, PassCosts

# (tokens drafted so far (i,) uint32, logits (1, vocab)) -> logits after the target's logits
# processors with the history continued by the drafted tokens (see loop.py).
DraftLogitsProcessor = Callable[[mx.array, mx.array], mx.array]
# i -> random key of the i-th drafted token's absolute position (seeded generations).
PositionKeys = Callable[[int], mx.array]

CATCH_UP_IN_STEP = 8  # unseen tokens the first draft step processes itself (no prefill)
SINGLE_WAIT = True  # see DraftModelDrafter; measured in bench/speculative.py ("device waits")
PROBE_TOKENS = 8  # tokens of the forward that measures a draft model's catch-up cost


@dataclass
class Draft:
    """Proposed tokens and the distributions they were drawn from.

    Attributes:
        array: (n,) uint32 proposed token ids (at most the requested k; may be empty), possibly
            not computed yet: the verify pass is built on them and one device wait serves both.
        probs: (n, vocab) float32 processed draft distributions q, or ``None`` when the
            proposals are deterministic (q is one-hot on each token) or seeded.
        caught_up: context tokens the drafter processed before drafting (more than 2: a catch-up,
            whose cost the planner books apart from the per-token drafting cost).
    """

    array: mx.array
    probs: mx.array | None = None
    caught_up: int = 0

    @property
    def tokens(self) -> list[int]:
        """The proposed token ids (waits for the device if they are not computed yet)."""
        return self.array.tolist()


def _draft_of(tokens: list[int]) -> Draft:
    return Draft(mx.array(tokens, mx.uint32))


class Drafter:
    """Base class: the incremental context shared by all drafters.

    ``prefix`` holds the tokens that precede the prompt in the target's prompt cache (a chat
    session or server sets it), so the drafter sees the whole conversation. ``step_seconds`` and
    ``catch_up_seconds`` are the drafter's estimates of one draft step and of processing one
    context token while catching up (priors for the planner), None if unknown.
    """

    name = "drafter"
    stops_early = True  # a check after any token of a plain stretch may end it (``agree``)
    round_seconds = 0.0  # the last ``agree``'s message to the other ranks (none in one process)
    step_seconds: float | None = None
    catch_up_seconds: float | None = None

    def __init__(self) -> None:
        self.prefix: list[int] = []
        self.context: list[int] = []  # every token the target conditions on, the last included
        self.pass_costs = PassCosts()  # the auto-k planner's measurements, kept across generations

    def begin(self, context: Sequence[int]) -> None:
        """Start a generation on ``context`` (O(len) once; keeps what is shared with before)."""
        self.context = list(context)

    def extend(self, tokens: Sequence[int]) -> None:
        """The target emitted ``tokens`` after the context (amortised O(len(tokens)))."""
        self.context += tokens

    def propose(
        self,
        k: int,
        sampling: SamplingParams,
        logits_processor: DraftLogitsProcessor | None = None,
        keys: PositionKeys | None = None,
    ) -> Draft:
        """Up to ``k`` tokens that likely follow the context.

        ``keys(i)`` (seeded generations) is the key a sampling drafter must draw its i-th token
        (0-based) with (``sampling.gumbel_argmax``): the key of that token's absolute position.
        """
        raise NotImplementedError

    def planner(self, num_draft_tokens: int | str, sampling: SamplingParams) -> DraftLengthPlanner:
        """What chooses k for each pass of a generation (``DraftLengthPlanner``, from this
        drafter's cost estimates and ``pass_costs``)."""
        return DraftLengthPlanner(num_draft_tokens, self.step_seconds, self.catch_up_seconds,
                                  self.pass_costs, greedy=sampling.greedy)

    def agree(self, k: int, stretch: int, watched: bool, most: int,
              propose: Callable[[], Draft]) -> tuple[int, int, Draft | None]:
        """What the next pass runs, ``(k, stretch, proposal)``: ``propose()`` (at most ``k``
        drafts) when k > 0, else ``stretch`` plain steps and None. One process runs what it
        decided; a sharded target's ranks run rank 0's decision (``mlxspec.distributed``), for
        which ``watched`` says that a check after each token would end the stretch early and
        ``most`` bounds every rank's k alike."""
        return k, stretch, (propose() if k else None)

    def can_propose(self) -> bool:
        """Whether ``propose`` would propose anything now (prompt lookup: only on a match).
        When not, the loop decodes plainly, pipelined, until it can: a pass with no draft is
        a plain step that could not overlap the next one's building."""
        return True

    def unseen(self) -> int:
        """How many context tokens the drafter must process before it can draft."""
        return 0

    def target_model(self, model: nn.Module) -> nn.Module:
        """What the loop runs as the target: ``model`` itself, or (a feature draft) a forward of
        it that also hands the drafter the hidden states it reads."""
        return model

    def unsupported_reason(self) -> str | None:
        """Why this drafter cannot run (e.g. a draft cache that cannot roll back), or None."""
        return None

    def reset(self) -> None:
        """Forget all state (a new conversation)."""
        self.prefix = []
        self.context = []


class DraftModelDrafter(Drafter):
    """A smaller model sharing the target's tokenizer, with its own KV cache.

    Args:
        model: the draft model.
        vocab_size: width of the target's logits; draft logits are cut or padded (with -inf) to it.
        real_vocab: number of real tokens; padded embedding rows beyond it are never proposed.
        max_kv_size: a sliding-window cache of this many tokens (bounded memory).
        min_confidence: stop drafting once the draft's most likely token has less probability
            than this (llama.cpp's ``--draft-p-min``); 0 drafts all k. Costs a device wait per
            drafted token.
        single_wait: leave the drafts uncomputed so the verify pass is queued behind them and
            the device is waited on once per pass (mlx-lm's way); False waits after drafting
            too (the drafting time is then measured apart).
    """

    name = "draft model"

    def __init__(
        self,
        model: nn.Module,
        *,
        vocab_size: int,
        real_vocab: int,
        max_kv_size: int | None = None,
        min_confidence: float = 0.0,
        single_wait: bool = SINGLE_WAIT,
    ):
        super().__init__()
        self.model = model
        self.max_kv_size = max_kv_size
        self.min_confidence = min_confidence
        self.single_wait = single_wait
        self.reset_cache()
        width = output_width(model)  # (also loads lazily-read weights before the timing below)
        self._vocab_fix = _vocab_fix(width, vocab_size, real_vocab)
        self.step_seconds = _forward_seconds(model, 1)
        self.catch_up_seconds = _forward_seconds(model, PROBE_TOKENS) / PROBE_TOKENS

    def reset_cache(self) -> None:
        self.cache = make_cache(self.model, self.max_kv_size)
        self._reason = cannot_roll_back(self.cache)
        if self._reason is None:  # sliding-window layers that can roll back rejected drafts
            swap_in_window_caches(self.cache)
        self.cached = 0  # context tokens whose keys/values are in self.cache
        self.pending = mx.array([], mx.uint32)  # drafted tokens in the cache after them

    def unsupported_reason(self) -> str | None:
        return self._reason and f"the draft model's {self._reason}"

    def reset(self) -> None:
        super().reset()
        self.reset_cache()

    def unseen(self) -> int:
        return len(self.context) - self.cached

    def begin(self, context: Sequence[int]) -> None:
        held = self.context[: self.cached]
        self.context = list(context)
        if cache_offset(self.cache) != self.cached + self.pending.size:  # interrupted: start over
            self.reset_cache()
            return
        keep = min(common_prefix_len(held, self.context), len(self.context) - 1)
        if not trim_cache(self.cache, cache_offset(self.cache) - keep):
            self.reset_cache()  # dropped past what a sliding window keeps: start over
            return
        self.cached, self.pending = keep, mx.array([], mx.uint32)

    def extend(self, tokens: Sequence[int]) -> None:
        # The drafts the target kept are already in the cache; drop the others.
        pending = self.pending.tolist()
        kept = common_prefix_len(pending, tokens)
        if not trim_cache(self.cache, len(pending) - kept):
            self.reset_cache()
        else:
            self.cached += kept
            self.pending = mx.array([], mx.uint32)
        self.context += tokens

    def propose(self, k, sampling, logits_processor=None, keys=None) -> Draft:
        if k == 0:
            return _draft_of([])
        feed = mx.array(self.context[self.cached :], mx.uint32)
        caught_up = feed.size
        if feed.size > CATCH_UP_IN_STEP:  # catch up on a long unseen stretch in bounded chunks
            prefill(self.model, self.cache, feed[:-1])
            feed = feed[-1:]
        drafted = mx.array([], mx.uint32)
        probs = []
        y = feed
        for i in range(k):
            logits = self._vocab_fix(self.model(y[None], cache=self.cache)[0, -1:, :])
            if logits_processor is not None:  # the target's, with the drafted history
                logits = logits_processor(drafted, logits)
            logprobs = normalized_logprobs(logits)
            if sampling.greedy:  # propose the draft's argmax
                y = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
                confidence = mx.exp(mx.max(logprobs))
            elif keys is not None:  # seeded: the Gumbel-max draw with the position's key
                q_log = processed_logprobs(logprobs, sampling)
                y = gumbel_argmax(q_log, keys(i))
                confidence = mx.exp(mx.max(q_log))
            else:  # sampling: draw from the draft's processed distribution q and report q
                q = processed_probs(logprobs, sampling)
                y = sample(q)
                probs.append(q)
                confidence = mx.max(q)
            drafted = mx.concatenate([drafted, y])
            if self.min_confidence > 0 and i + 1 < k and confidence.item() < self.min_confidence:
                break
        probs = mx.concatenate(probs) if probs else None
        if not self.single_wait:
            mx.eval(drafted, probs)
        self.cached = len(self.context)
        self.pending = drafted[:-1]  # the last draft token was sampled, not fed
        return Draft(drafted, probs, caught_up=caught_up)


class PromptLookupDrafter(Drafter):
    """Prompt lookup: continue the latest earlier occurrence of the context's last n-gram.

    No model and next to no cost: proposals are deterministic (q one-hot), which wins on
    input-grounded tasks (rewriting, summarising, code edits) where the output copies the input.
    The n-gram index grows with the context (amortised O(ngram_max) per token); a match close to
    the end continues periodically (``[1, 2, 3] * 10`` proposes ``1 2 3 1 2 3 ...``).
    """

    name = "prompt lookup"
    step_seconds = catch_up_seconds = 0.0

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        super().__init__()
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.reset_index()

    def reset_index(self) -> None:
        self.indexed = 0  # n-grams ending before context[indexed] are in self.latest
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence

    def reset(self) -> None:
        super().reset()
        self.reset_index()

    def begin(self, context: Sequence[int]) -> None:
        shared = common_prefix_len(self.context, context)
        self.context = list(context)
        if shared < self.indexed:  # the context changed under us: index it afresh
            self.reset_index()
        self._index()  # the one-off cost of a long prompt is paid here, not in a draft step

    def _index(self) -> None:
        """Index every n-gram that ends before the context's last token."""
        context = self.context
        for end in range(max(self.indexed, 1), len(context)):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                self.latest[tuple(context[end - n : end])] = end
        self.indexed = max(len(context) - 1, self.indexed)

    def propose(self, k, sampling, logits_processor=None, keys=None) -> Draft:
        return _draft_of(self.match(k)[1])

    def can_propose(self) -> bool:
        return self.match(1)[0] > 0

    def match(self, k: int) -> tuple[int, list[int]]:
        """``(n, tokens)``: the longest n-gram ending the context that occurred before, and the
        ``k`` tokens that followed it (``(0, [])`` when none did)."""
        self._index()
        context, size = self.context, len(self.context)
        for n in range(min(self.ngram_max, size), self.ngram_min - 1, -1):
            end = self.latest.get(tuple(context[size - n :]))
            if end is not None:  # propose what followed that occurrence, periodically
                tokens = context[end : end + k]
                while len(tokens) < k:  # the match runs into the end: the pattern repeats
                    tokens.append(tokens[len(tokens) - (size - end)])
                return n, tokens
        return 0, []


def _forward_seconds(model: nn.Module, tokens: int) -> float:
    """Seconds of one forward over ``tokens`` tokens (a fresh cache)."""
    tic = time.perf_counter()
    mx.eval(model(mx.zeros((1, tokens), mx.uint32), cache=make_cache(model)))
    return time.perf_counter() - tic


def output_width(model: nn.Module) -> int:
    """Width of the model's logits (its embedding rows), from one forward of a single token."""
    return int(model(mx.array([[0]]), cache=make_cache(model)).shape[-1])


def _vocab_fix(width: int, vocab_size: int, real_vocab: int) -> Callable[[mx.array], mx.array]:
    """Map draft logits (..., width) onto the target's (..., vocab_size); ids >= real_vocab -inf."""
    if width == vocab_size and real_vocab >= width:
        return lambda logits: logits
    allowed = mx.arange(vocab_size) < min(width, real_vocab)  # a real token the draft scores

    def fix(logits: mx.array) -> mx.array:
        if width > vocab_size:
            logits = logits[..., :vocab_size]
        elif width < vocab_size:
            pad = mx.full((*logits.shape[:-1], vocab_size - width), -mx.inf, logits.dtype)
            logits = mx.concatenate([logits, pad], axis=-1)
        return mx.where(allowed, logits, -mx.inf)

    return fix
