"""Draft models made from the target itself: an early-exit copy and a quantized copy."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxspec import cpu


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
    cpu.prepare(copy)  # as mlxspec.load does: on a CPU, the packed-weight kernel
    return copy
