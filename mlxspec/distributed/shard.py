"""Shard a loaded model over the group: tensor parallel (the models' own ``shard()``, MLX's
sharded and quantized sharded linear layers) or pipeline parallel (mlx-lm's ``PipelineMixin``,
added here for the llama family, which mlx-lm does not pipeline).

Tensor parallelism splits attention heads and the MLP's hidden width across ranks; a model whose
heads do not divide by the world size (SmolLM2-135M: 9 query and 3 KV heads) keeps attention
whole on every rank and splits only the MLP (one all-reduce per layer instead of two).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import shard_linear
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.pipeline import PipelineMixin

from mlxspec.distributed.drafting import SharedDrafter, drafter_on_rank_0
from mlxspec.distributed.group import (
    DistributedError,
    Watchdog,
    init_group,
    ordered_all_sum,
    silence_followers,
)
from mlxspec.speculative.drafters import Drafter
from mlxspec.speculative.feature import head_logits, layered_forward

SHARD_MODES = ("tensor", "pipeline")


def _heads_divide(model: nn.Module, n: int) -> bool:
    args = model.args
    kv = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    return args.num_attention_heads % n == 0 and kv % n == 0


def _shard_mlp(model: nn.Module, group: mx.distributed.Group) -> None:
    for layer in model.layers:
        mlp = layer.mlp
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def shard_tensor(model: nn.Module, group: mx.distributed.Group) -> str:
    """Tensor-parallel ``model`` in place; returns the layout ("heads+mlp" or "mlp")."""
    if _heads_divide(model, group.size()) and hasattr(model, "shard"):
        model.shard(group)
        return "heads+mlp"
    if not all(hasattr(getattr(layer, "mlp", None), "gate_proj") for layer in model.layers):
        raise DistributedError(
            f"{model.model_type}: its heads do not divide by {group.size()} ranks and its MLP is "
            "not a gated MLP: use --shard pipeline")
    _shard_mlp(model, group)
    return "mlp"


class PipelineLlamaModel(PipelineMixin, llama.LlamaModel):
    """``llama.LlamaModel`` whose ranks each run a slice of the layers (mlx-lm's ``PipelineMixin``
    split: the last rank takes the first layers). Each stage ends in an all-sum to which only its
    owner contributes (the others add zeros, so the sum is exact): every rank then holds the
    stage's hidden state (batch, seq, hidden). Only all-sums, no send/recv; each rank's sums
    are chained (a non-owner's zeros depend on the previous sum), so every rank runs them in the
    same order. ``stage_bounds[r]``: the layers ``(start, end)`` rank r runs."""

    stage_bounds: list[tuple[int, int]]

    def __call__(self, inputs: mx.array, cache: Any = None,
                 input_embeddings: mx.array | None = None) -> mx.array:
        return self.tapped(inputs, cache, (), input_embeddings)[0]

    def tapped(self, inputs: mx.array, cache: Any = None, taps: Sequence[int] = (),
               input_embeddings: mx.array | None = None) -> tuple[mx.array, list[mx.array]]:
        """The final norm's output (batch, seq, hidden) and, on rank 0 (the rank that drafts),
        the hidden states entering the layers ``taps`` (layer count: the last layer's output),
        each (batch, seq, hidden); [] on the other ranks.

        A tap inside another rank's stage rides that stage's all-sum (concatenated after the
        hidden state, zeros from the other ranks): no collective round of its own. A tap at a
        stage's first layer is the previous sum, which every rank holds.
        """
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        rank, size = self.pipeline_rank, self.pipeline_size
        cache = cache if cache is not None else [None] * len(self.pipeline_layers)
        mask = create_attention_mask(h, cache[0])
        width, taken = h.shape[-1], {}
        for stage in reversed(range(size)):
            start, end = self.stage_bounds[stage]
            taken.update((j, h) for j in taps if j == start)
            # Rank 0's own taps stay on rank 0; another stage's travel with its sum.
            riding = [j for j in taps if start < j < end] if stage != 0 else []
            if stage == rank:
                for i, (layer, c) in enumerate(zip(self.pipeline_layers, cache, strict=True)):
                    if i > 0 and start + i in taps:  # (a tap at i = 0 was taken above)
                        taken[start + i] = h
                    h = layer(h, mask, cache=c)
                payload = mx.concatenate([h, *(taken[j] for j in riding)], axis=-1) if riding else h
            else:
                # The zeros depend on h, the previous stage's sum: without it nothing orders a
                # rank's all-sums of zeros after its earlier ones, the ranks could pair
                # different stages' sums, and the group hung or computed garbage.
                shape = (*h.shape[:-1], width * (1 + len(riding)))
                payload = mx.depends(mx.zeros(shape, h.dtype), h)
            total = mx.distributed.all_sum(payload)
            h = total[..., :width] if riding else total
            taken.update((j, total[..., (n + 1) * width:(n + 2) * width])
                         for n, j in enumerate(riding))
        taken.update((j, h) for j in taps if j == self.stage_bounds[0][1])
        if cache[-1] is not None:
            # Every rank evaluates every stage's all-sum whenever it evaluates its caches
            # (prefill) or the logits: a collective one rank skipped would block the other.
            cache[-1].keys = mx.depends(cache[-1].keys, h)
        return self.norm(h), [taken[j] for j in taps] if rank == 0 else []


class PipelineLlama(llama.Model):
    """``llama.Model`` over a :class:`PipelineLlamaModel`: its caches cover its own layers."""

    @property
    def layers(self) -> list:
        return self.model.pipeline_layers


def shard_pipeline(model: nn.Module, group: mx.distributed.Group) -> str:
    """Pipeline-parallel ``model`` in place (mlx-lm's own ``pipeline()`` where the model has it,
    else the llama family here); returns the layout, e.g. "layers 15-29 of 30"."""
    inner = getattr(model, "model", None)
    if inner is not None and not hasattr(inner, "pipeline"):
        if not isinstance(model, llama.Model) or any(
                getattr(layer, "use_sliding", False) for layer in inner.layers):
            raise DistributedError(
                f"{model.model_type}: no pipeline support in mlx-lm for this model: use "
                "--shard tensor")
        n = len(inner.layers)
        inner.__class__, model.__class__ = PipelineLlamaModel, PipelineLlama
        inner.pipeline_rank, inner.pipeline_size, inner.start_idx, inner.end_idx = 0, 1, 0, n
    if inner is None or not hasattr(inner, "pipeline"):
        raise DistributedError(f"{model.model_type}: cannot be pipelined: use --shard tensor")
    total = len(inner.layers)
    inner.pipeline(group)
    for i in range(inner.start_idx):  # free the weights of the layers other ranks run
        inner.layers[i] = None
    if isinstance(inner, PipelineLlamaModel):  # every rank's layers: where a tap is computed
        bounds = np.zeros((group.size(), 2), np.int32)
        bounds[group.rank()] = inner.start_idx, inner.end_idx
        summed = ordered_all_sum(bounds.ravel(), group).reshape(-1, 2)
        inner.stage_bounds = [(int(a), int(b)) for a, b in summed]
    return f"layers {inner.start_idx}-{inner.end_idx - 1} of {total}"


class _Beating:
    """Mixed into a sharded model's class: every forward pass tells the watchdog it started, and
    the speculative loop drafts on rank 0 alone (:mod:`mlxspec.distributed.drafting`)."""

    watchdog: Watchdog

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        self.watchdog.beat()
        return super().__call__(*args, **kwargs)

    def share_drafter(self, draft: Drafter) -> Drafter:
        """``draft`` proposing on rank 0 only, its proposals sent to the other ranks."""
        return SharedDrafter(draft, mx.distributed.init())

    def drafter_on_rank_0(self, build: Callable[[], Drafter | None]) -> Drafter | None:
        """``build()`` on rank 0; a stand-in that drafts nothing on the others."""
        return drafter_on_rank_0(build, self, mx.distributed.init())


class _Tapping(_Beating):
    """A sharded model whose ranks can hand the hidden states a feature draft reads to rank 0:
    tensor parallel (every rank runs every layer) or the llama pipeline."""

    def tapped_forward(self, inputs: mx.array, cache: Any,
                       taps: Sequence[int]) -> tuple[mx.array, mx.array | None]:
        """``mlxspec.speculative.feature.tapped_forward``: ``(logits (B, T, vocab), features
        (B, T, len(taps) * hidden))``, the features on rank 0 alone (None elsewhere)."""
        self.watchdog.beat()
        if not isinstance(self.model, PipelineLlamaModel):
            logits, features = layered_forward(self, inputs, cache, taps)
            return logits, features if mx.distributed.init().rank() == 0 else None
        h, taken = self.model.tapped(inputs, cache, taps)
        return head_logits(self, h), mx.concatenate(taken, axis=-1) if taken else None


def shard_model(model: nn.Module, mode: str, group: mx.distributed.Group) -> str:
    """Shard ``model`` in place in ``mode`` ("tensor" or "pipeline"); returns its layout.

    Then the integer zero-points of the MLX affine layers this rank keeps whole are recovered
    (``mlxspec.quant.storage.adopt_zero_points``: MLX's ``shard_linear`` cannot split a
    zero-point layer), before the rank's parameters are evaluated: the check's float64 copy of
    the embedding's scales (about 36 MiB on the default model) then does not come on top of the
    weights.
    """
    from mlxspec.quant.storage import adopt_zero_points

    if mode not in SHARD_MODES:
        raise DistributedError(f"--shard {mode}: use one of {', '.join(SHARD_MODES)}")
    layout = (shard_tensor if mode == "tensor" else shard_pipeline)(model, group)
    adopt_zero_points(model)
    mx.eval(model.parameters())
    return layout


def load_sharded(spec: Any, mode: str | None, **kwargs: Any) -> tuple[nn.Module, Any]:
    """``mlxspec.load(spec)`` then, with ``mode``, shard it over the launcher's group.

    Rank 0 loads first (a GGUF file is converted once into the shared cache), the others after a
    barrier. The load is lazy and sharding comes before evaluation, so each rank reads only what it
    keeps: a pipeline rank its own layers (with the embedding, norm and head every stage runs),
    never the others' weights; a tensor rank reads each split tensor whole from its file and
    keeps its slice (the whole tensor's buffer is freed once sliced). The integer zero-points of
    MLX affine layers (``mlxspec.quant.storage.adopt_zero_points``, which reads each layer's
    scales and biases) are recovered after sharding, for the rank's own layers: a layer that
    tensor parallelism split stays MLX's sharded quantized layer (MLX cannot shard mlxspec's
    zero-point layer). Ranks other than 0 print nothing from here on; a watchdog ends every rank
    with exit status 2 (rank 0: one ``error:`` line) when a forward pass does not start within
    the timeout.
    """
    from mlxspec import cpu
    from mlxspec.load import load

    if mode is None:
        return load(spec, **kwargs)
    group = init_group()
    silence_followers()
    if group.rank() == 0:
        model, tokenizer = load(spec, lazy=True, zero_points=False, **kwargs)
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))  # barrier: rank 0 has loaded
    if group.rank() != 0:
        model, tokenizer = load(spec, lazy=True, zero_points=False, **kwargs)
    layout = shard_model(model, mode, group)  # zero-points: the rank's own layers, after
    mx.clear_cache()  # the buffers of tensors read whole and then sliced go back to the system
    cpu.prepare(model)  # now that its weights are there: the CPU backend's steps a lazy load skips
    model.shard_layout = f"{mode}: {layout}"  # a str: not a parameter of the module
    watchdog = Watchdog()
    tapping = mode == "tensor" or isinstance(getattr(model, "model", None), PipelineLlamaModel)
    model.__class__ = type(f"Beating{type(model).__name__}",
                           (_Tapping if tapping else _Beating, type(model)), {"watchdog": watchdog})
    watchdog.__enter__()
    return model, tokenizer
