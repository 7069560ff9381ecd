"""The running rows' decode step and the prompts joining the batch in one forward.

A prompt joining a running batch in a forward of its own costs a second pass over the weights on
a memory-bound CPU, and every running row waits for it (SmolLM2 on 2 cores: a 13-token prompt
~48 ms on top of a ~70 ms step of 8 rows, about one step in eight with 8 clients sending short
requests; timed in-process, no result file). Here its tokens join the decode step's rows in
every weight product (one pass, 8 + 13 rows), and only the attention runs apart, each part on
its own KV cache with its own mask, through mlx-lm's own ``Attention``: its projections are
computed jointly beforehand and handed to it for the call (``_given_projections``), its output
projection is applied jointly afterwards.

The numbers are those of the two forwards: the weight products of up to ``MAX_FUSED_ROWS`` rows
compute every output the same way whatever the number of rows (``mlxspec.cpu.blas``'s kernel; more
rows go to sgemm, whose sums depend on the shape), norms and activations are row by row, and
the attention of each part is the one it would get alone (``tests/serving/test_fused_prefill.py``
compares the logits bitwise).

Only models whose blocks are mlx-lm's pre-norm ``input_layernorm -> self_attn ->
post_attention_layernorm -> mlp`` with full attention (``FUSED_MODEL_TYPES``) take this path;
others are prefilled in a forward of their own.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

# mlx-lm model types built as above (llama's family): embed_tokens, layers of pre-norm blocks
# with q/k/v/o projections, a final norm, a tied or separate output head.
FUSED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# Rows of the weight products at most (decode rows plus prompt tokens, padding included): up to
# this many, every output is summed the same way as in the separate forwards (the BLAS shim's
# kernel takes up to 24 rows); a longer prompt costs about as much as a step of its own anyway.
MAX_FUSED_ROWS = 24


@dataclass
class Part:
    """One group of rows in the forward: ``tokens`` (rows, length) on ``cache`` (one entry per
    layer), and the position per row whose logits are wanted (``last``; None: the last)."""

    tokens: mx.array
    cache: list[Any]
    last: list[int] | None = None


def supported(model: nn.Module) -> bool:
    """Whether ``fused_logits`` can run ``model`` (an mlx-lm llama-family model, full attention)."""
    if getattr(model, "shard_layout", None) is not None:
        return False  # sharded (mlxspec.distributed): only the model's own forward is split
    inner = model.get("model") if isinstance(model, nn.Module) else None
    if getattr(model, "model_type", None) not in FUSED_MODEL_TYPES or not isinstance(
            inner, nn.Module):
        return False
    if getattr(inner, "swa_idx", None) is not None or not inner.get("layers"):
        return False
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", None)
    if tied is None or (not tied and "lm_head" not in model):
        return False
    block = inner.layers[0]
    attn = block.get("self_attn")
    return (all(name in block for name in ("input_layernorm", "post_attention_layernorm", "mlp"))
            and isinstance(attn, nn.Module)
            and all(name in attn for name in ("q_proj", "k_proj", "v_proj", "o_proj")))


class _Given(nn.Module):
    """A projection whose output is already computed (the joint product's share)."""

    def __init__(self, value: mx.array):
        super().__init__()
        self.value = value

    def __call__(self, x: mx.array) -> mx.array:
        return self.value


class _Identity(nn.Module):
    def __call__(self, x: mx.array) -> mx.array:
        return x


@contextmanager
def _given_projections(attn: nn.Module, q: mx.array, k: mx.array, v: mx.array):
    """``attn`` with its q/k/v projections returning ``q``, ``k``, ``v`` and no output
    projection, for one call."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    saved = [attn[name] for name in names]
    attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj = _Given(q), _Given(k), _Given(v), _Identity()
    try:
        yield
    finally:
        for name, module in zip(names, saved, strict=True):
            attn[name] = module


def _block(block: nn.Module, flat: mx.array, shapes: list[tuple[int, int]], masks: list[Any],
           caches: list[Any]) -> mx.array:
    """One pre-norm transformer block over the parts' hidden states, concatenated in ``flat``
    (1, tokens, hidden): joint weight products, attention part by part."""
    attn = block.self_attn
    x = block.input_layernorm(flat)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    outputs, start = [], 0
    for (rows, length), mask, cache in zip(shapes, masks, caches, strict=True):
        n = rows * length

        def share(a: mx.array, start=start, n=n, rows=rows, length=length) -> mx.array:
            return a[:, start : start + n].reshape(rows, length, a.shape[-1])

        with _given_projections(attn, share(q), share(k), share(v)):
            outputs.append(attn(share(x), mask, cache).reshape(1, n, -1))
        start += n
    h = flat + attn.o_proj(mx.concatenate(outputs, axis=1))
    return h + block.mlp(block.post_attention_layernorm(h))


def fused_logits(model: nn.Module, parts: list[Part]) -> list[mx.array]:
    """The logits of each part, (rows, vocabulary) at its wanted positions, from one forward
    (``supported(model)`` must hold); every part's cache advances by its tokens, as the
    model's own forward would advance it."""
    inner = model.model
    hidden = [inner.embed_tokens(p.tokens) for p in parts]
    masks = [create_attention_mask(h, p.cache[0]) for h, p in zip(hidden, parts, strict=True)]
    shapes = [(p.tokens.shape[0], p.tokens.shape[1]) for p in parts]
    flat = mx.concatenate([h.reshape(1, -1, h.shape[-1]) for h in hidden], axis=1)
    for i, block in enumerate(inner.layers):
        flat = _block(block, flat, shapes, masks, [p.cache[i] for p in parts])
    picked, start = [], 0
    for (rows, length), p in zip(shapes, parts, strict=True):
        h = flat[0, start : start + rows * length].reshape(rows, length, -1)
        picked.append(h[:, -1] if p.last is None else h[mx.arange(rows), mx.array(p.last)])
        start += rows * length
    h = inner.norm(mx.concatenate(picked))
    logits = inner.embed_tokens.as_linear(h) if model.args.tie_word_embeddings else model.lm_head(h)
    bounds = list(itertools.accumulate(rows for rows, _ in shapes[:-1]))
    return mx.split(logits, bounds) if bounds else [logits]


class WithPrefill:
    """The model as the running batch calls it (``model(inputs, cache=...)``): a prefill queued
    with ``queue`` runs in the next call's forward, its logits kept for ``take``."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.supported = supported(model)
        self._queued: Part | None = None
        self._logits: mx.array | None = None

    def queue(self, part: Part) -> None:
        self._queued = part

    def discard(self) -> None:
        """Forget a queued prefill that did not run (its step failed)."""
        self._queued = self._logits = None

    def take(self) -> mx.array:
        """The queued prefill's logits (rows, vocabulary), once its forward ran."""
        logits, self._logits = self._logits, None
        if logits is None:
            raise RuntimeError("the queued prefill did not run")
        return logits

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        part, self._queued = self._queued, None
        if part is None:
            return self.model(inputs, cache=cache)
        decode, self._logits = fused_logits(self.model, [Part(inputs, cache), part])
        return decode[:, None]
