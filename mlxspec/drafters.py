"""Drafters: what proposes the tokens that speculative decoding verifies.

A drafter proposes up to ``k`` next tokens for a context, with the probabilities it drew them from
(``None`` means deterministic proposals, q = one-hot). The verifier in ``mlxspec.speculative`` needs
nothing else, so a quantized copy of the target or a distilled draft plugs in without touching it.

Every drafter keeps its own record of the context it has seen and re-synchronises to the context
it is given by longest common prefix: rejected drafts, a new chat turn or a re-rendered
conversation only cost the tokens that differ.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.errors import TokenizerMismatchError
from mlxspec.generate import SamplingParams
from mlxspec.sampling import normalized_logprobs, processed_probs, sample
from mlxspec.window_cache import make_cache, rollback_cache

# (tokens drafted so far (i,) uint32, logits (1, vocab)) -> processed logits; see speculative.py.
Process = Callable[[mx.array, mx.array], mx.array]

PREFILL_STEP = 2048  # tokens per forward when catching up on a long context (as mlx-lm)
PROBE_TOKENS = 8  # tokens of the forward that measures a draft model's catch-up cost


@dataclass
class Draft:
    """Proposed tokens and the distributions they were drawn from.

    Attributes:
        tokens: the proposed token ids (at most the requested k; may be empty).
        probs: (len(tokens), vocab) float32 processed draft distributions q, or ``None`` when the
            proposals are deterministic (q is one-hot on each token).
        fed: context tokens the drafter had to process before drafting (a catch-up when > 2).
    """

    tokens: list[int]
    probs: mx.array | None = None
    fed: int = 0


class Drafter:
    """Base class: ``propose`` plus the context bookkeeping shared by all drafters.

    ``prefix`` holds the tokens that precede the prompt in the target's prompt cache (a chat
    session sets it every turn), so the drafter sees the whole conversation. ``step_seconds`` and
    ``catch_up_seconds`` are the drafter's estimates of one draft step and of processing one
    context token while catching up (priors for the planner), None if unknown.
    """

    name = "drafter"
    step_seconds: float | None = None
    catch_up_seconds: float | None = None

    def __init__(self) -> None:
        self.prefix: list[int] = []

    def propose(
        self, context: Sequence[int], k: int, sampling: SamplingParams, process: Process | None
    ) -> Draft:
        """Up to ``k`` tokens that likely follow ``context`` (all tokens so far)."""
        raise NotImplementedError

    def unseen(self, context: Sequence[int]) -> int:
        """How many tokens of ``context`` the drafter would have to process before drafting."""
        return 0

    def unsupported_reason(self) -> str | None:
        """Why this drafter cannot run (e.g. a draft cache that cannot roll back), or None."""
        return None

    def reset(self) -> None:
        """Forget all state (a new conversation)."""
        self.prefix = []


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (C-speed slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    if list(a[:hi]) == list(b[:hi]):
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi+1] != b[:hi+1]
        mid = (lo + hi + 1) // 2
        if list(a[lo:mid]) == list(b[lo:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class DraftModelDrafter(Drafter):
    """A smaller model sharing the target's tokenizer, with its own KV cache.

    Args:
        model: the draft model.
        vocab_size: width of the target's logits; draft logits are cut or padded (with -inf) to it.
        real_vocab: number of real tokens; padded embedding rows beyond it are never proposed.
        max_kv_size: a sliding-window cache of this many tokens (bounded memory).
    """

    name = "draft model"

    def __init__(
        self, model: nn.Module, *, vocab_size: int, real_vocab: int, max_kv_size: int | None = None
    ):
        super().__init__()
        self.model = model
        self.max_kv_size = max_kv_size
        self.reset_cache()
        width = output_width(model)  # (also loads lazily-read weights before the timing below)
        self._vocab_fix = _vocab_fix(width, vocab_size, real_vocab)
        self.step_seconds = _forward_seconds(model, 1)
        self.catch_up_seconds = _forward_seconds(model, PROBE_TOKENS) / PROBE_TOKENS

    def unsupported_reason(self) -> str | None:
        return self._reason and f"the draft model's {self._reason}"

    def reset(self) -> None:
        super().reset()
        self.reset_cache()

    def unseen(self, context: Sequence[int]) -> int:
        return len(context) - min(common_prefix_len(self.cached, context), len(context) - 1)

    def _sync(self, context: Sequence[int]) -> list[int]:
        """Roll the cache back to the longest prefix it shares with ``context``; returns the rest."""
        if self.cache[0].offset != len(self.cached):  # an interrupted proposal: start over
            self.reset_cache()
        keep = min(common_prefix_len(self.cached, context), len(context) - 1)
        drop = len(self.cached) - keep
        if drop > 0 and any(c.trim(drop) != drop for c in self.cache):
            self.reset_cache()  # dropped past what a sliding window keeps: start over
            keep = 0
        self.cached = list(context[:keep])
        return list(context[keep:])

    def reset_cache(self) -> None:
        self.cache, self._reason = rollback_cache(make_cache(self.model, self.max_kv_size))
        self.cached: list[int] = []  # the tokens whose keys/values are in self.cache

    def propose(self, context, k, sampling, process=None) -> Draft:
        if k == 0:
            return Draft([])
        feed = self._sync(context)
        y = mx.array(feed, mx.uint32)
        while y.size > PREFILL_STEP:  # catch up on a long context in bounded chunks
            self.model(y[None, :PREFILL_STEP], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            y = y[PREFILL_STEP:]
        drafted = mx.array([], mx.uint32)
        probs = []
        for _ in range(k):
            logits = self._vocab_fix(self.model(y[None], cache=self.cache)[0, -1:, :])
            if process is not None:  # the target's logits processors, with the drafted history
                logits = process(drafted, logits)
            logprobs = normalized_logprobs(logits)
            if sampling.temp == 0:  # greedy: propose the draft's argmax
                y = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
            else:  # sampling: draw from the draft's processed distribution q and report q
                q = processed_probs(logprobs, sampling)
                y = sample(q)
                probs.append(q)
            drafted = mx.concatenate([drafted, y])
        mx.eval(drafted, probs)
        tokens = drafted.tolist()
        self.cached += feed + tokens[:-1]  # the last draft token was sampled, not fed
        return Draft(tokens, mx.concatenate(probs) if probs else None, fed=len(feed))


class PromptLookupDrafter(Drafter):
    """Prompt lookup: continue the latest earlier occurrence of the context's last n-gram.

    No model and next to no cost: proposals are deterministic (q one-hot), which wins on
    input-grounded tasks (rewriting, summarising, code edits) where the output copies the input.
    """

    name = "prompt lookup"
    step_seconds = catch_up_seconds = 0.0

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        super().__init__()
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.reset_index()

    def reset_index(self) -> None:
        self.seen: list[int] = []  # the context indexed so far
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence

    def reset(self) -> None:
        super().reset()
        self.reset_index()

    def _index(self, context: Sequence[int]) -> None:
        """Index every n-gram that ends before the context's last token."""
        if common_prefix_len(self.seen, context) < len(self.seen):
            self.reset_index()  # the context changed under us: index it afresh
        for end in range(max(len(self.seen), 1), len(context)):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                self.latest[tuple(context[end - n : end])] = end
        self.seen = list(context[: max(len(context) - 1, 0)])

    def propose(self, context, k, sampling, process=None) -> Draft:
        self._index(context)
        for n in range(min(self.ngram_max, len(context)), self.ngram_min - 1, -1):
            end = self.latest.get(tuple(context[len(context) - n :]))
            if end is not None:  # propose what followed that occurrence
                return Draft(list(context[end : end + k]))
        return Draft([])


def first_layers_copy(model: nn.Module, layers: int | None = None) -> nn.Module:
    """A new model object sharing ``model``'s weights, with only its first ``layers`` decoder
    blocks (all of them for None): a self-draft that exits early, or the base of a quantized copy.
    """
    args = model.args
    if layers is not None:
        changes = {"num_hidden_layers": layers}
        if getattr(args, "layer_types", None):  # per-layer attention kinds (e.g. Gemma-3)
            changes["layer_types"] = args.layer_types[:layers]
        args = dataclasses.replace(args, **changes)
    copy = type(model)(args)
    weights = {k: v for k, v in tree_flatten(model.parameters())
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < len(copy.layers)}
    copy.load_weights(list(copy.sanitize(weights).items()))  # sanitize: e.g. tied embeddings
    return copy


def quantized_copy(model: nn.Module, bits: int = 4, group_size: int = 64) -> nn.Module:
    """A copy of ``model`` quantized with mlx-lm's affine round-to-nearest: a draft that shares
    the target's tokenizer by construction."""
    copy = first_layers_copy(model)
    nn.quantize(copy, group_size=group_size, bits=bits)
    mx.eval(copy.parameters())
    return copy


def _forward_seconds(model: nn.Module, tokens: int) -> float:
    """Seconds of one forward over ``tokens`` tokens (a fresh cache)."""
    tic = time.perf_counter()
    mx.eval(model(mx.zeros((1, tokens), mx.uint32), cache=make_prompt_cache(model)))
    return time.perf_counter() - tic


def output_width(model: nn.Module) -> int:
    """Width of the model's logits (its embedding rows), from one forward of a single token."""
    return int(model(mx.array([[0]]), cache=make_prompt_cache(model)).shape[-1])


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


# -- tokenizer compatibility ---------------------------------------------------------------------


def _tokens_by_id(tokenizer: Any) -> list[str | None]:
    vocab = tokenizer.get_vocab()
    by_id: list[str | None] = [None] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        by_id[i] = token
    return by_id


def real_vocab_size(tokenizer: Any) -> int:
    """Number of token ids the tokenizer can produce (largest id + 1)."""
    return max(tokenizer.get_vocab().values()) + 1


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    eos = getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id]
    return {
        "BOS": tokenizer.bos_token_id,
        "EOS": sorted(i for i in eos if i is not None),
        "PAD": tokenizer.pad_token_id,
        "special tokens": sorted(getattr(tokenizer, "all_special_tokens", []) or []),
    }


def check_tokenizers(target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Raise ``TokenizerMismatchError`` unless the draft tokenizes exactly like the target.

    Token -> id must agree on the ids both tokenizers have, and BOS, EOS, PAD and the special
    (chat template) tokens must be the same. Different vocabulary lengths are allowed (embedding
    matrices padded to different sizes); the draft never proposes ids the target lacks.
    """
    target, draft = _tokens_by_id(target_tokenizer), _tokens_by_id(draft_tokenizer)
    shared = min(len(target), len(draft))
    if target[:shared] != draft[:shared]:
        i = common_prefix_len(target[:shared], draft[:shared])
        raise TokenizerMismatchError(
            f"the draft model's tokenizer differs from the target's: token id {i} is "
            f"{target[i]!r} for the target but {draft[i]!r} for the draft; use a draft model "
            "of the same family (same tokenizer)"
        )
    target_special, draft_special = (
        _special_tokens(target_tokenizer),
        _special_tokens(draft_tokenizer),
    )
    for kind, value in target_special.items():
        if draft_special[kind] != value:
            raise TokenizerMismatchError(
                f"the draft model's tokenizer has different {kind} ({draft_special[kind]!r}, the "
                f"target's are {value!r}); use a draft model of the same family (same tokenizer)"
            )
