"""Multi-token-prediction (MTP) layers that ship inside a checkpoint, run as a feature draft.

MiMo (``model_type: mimo``, mlx-lm's ``mimo.py``) carries ``num_nextn_predict_layers`` MTP
layers under ``model.mtp_layers.{i}.*``, which mlx-lm's ``sanitize`` drops. ``attach_mtp`` keeps
them at load (outside the model's parameters: quantizing, saving and byte counts are unchanged)
and ``MTPHead`` runs the first one as a ``FeatureDrafter`` head (``--draft mtp``), as vLLM's
``mimo_mtp.py`` does. One MTP layer, at position p (token p + 1 after it):

    e = token_layernorm(embed(token p + 1))            (position 0's embedding is zeroed)
    h = hidden_layernorm(norm(target's last hidden state at p))
    x = input_proj([h, e])                             (2H -> H)
    out = a decoder layer of the target's kind over x  (its own KV cache, RoPE at p)
    logits = target's lm_head(final_layernorm(out))    (predicts token p + 2)

Chained steps read the layer's own ``final_layernorm(out)`` as the hidden state, with the first
layer reused at every step (vLLM's chaining). The draft vocabulary is the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import mimo
from mlx_lm.models.base import create_attention_mask

from mlxspec.errors import CorruptModelError, UnsupportedModelError


class MTPLayer(mimo.TransformerBlock):
    """One MiMo MTP layer: mlx-lm's decoder layer (``input_layernorm``, ``self_attn.*``,
    ``mlp.*``, ``post_attention_layernorm``) with the norms and projection around it."""

    def __init__(self, args: mimo.ModelArgs):
        super().__init__(args)
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.token_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.hidden_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.final_layernorm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, mask: Any, cache: Any) -> mx.array:
        """Pre-``final_layernorm`` output (B, T, H) of ``embeds`` and normed ``hidden``."""
        x = self.input_proj(mx.concatenate(
            [self.hidden_layernorm(hidden), self.token_layernorm(embeds)], axis=-1))
        return super().__call__(x, mask, cache)


# model_type -> (the prefix of its MTP weights, the layer class they load into)
MTP_LAYOUTS = {"mimo": ("model.mtp_layers.", MTPLayer)}


@dataclass
class MTPConfig:
    """The fields ``FeatureDrafter`` reads of a head's config."""

    taps: list[int]
    target_hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    extra: dict = field(default_factory=dict)


class MTPHead(nn.Module):
    """A checkpoint's MTP layer behind the EAGLE-3 head interface (``step``, ``logits``).

    Shapes: tokens (B, T) uint32; hidden (B, T, H): the target's last layer output before its
    final norm (tap L), or the previous step's output; out (B, T, H).
    """

    def __init__(self, model: nn.Module, layers: list[MTPLayer]):
        super().__init__()
        inner = model.model
        hidden, rows = int(model.args.hidden_size), int(inner.embed_tokens.weight.shape[0])
        self.layer = layers[0]
        self.config = MTPConfig(taps=[len(inner.layers)], target_hidden_size=hidden,
                                vocab_size=rows, draft_vocab_size=rows)
        self.d2t = mx.zeros((rows,), mx.int32)
        object.__setattr__(self, "target", model)  # shared, not the head's parameters

    @property
    def dtype(self) -> mx.Dtype:
        return self.layer.input_proj.weight.dtype

    def draft_ids(self) -> mx.array:
        return mx.arange(self.config.draft_vocab_size, dtype=mx.int32)

    def step(self, tokens: mx.array, hidden: mx.array, cache: Any, features: bool) -> mx.array:
        inner = self.target.model
        hidden = inner.norm(hidden) if features else self.layer.final_layernorm(hidden)
        embeds = inner.embed_tokens(tokens).astype(hidden.dtype)
        if cache[0].offset == 0:  # vLLM masks the first position's token (MTP has no use for it)
            embeds = mx.concatenate([mx.zeros_like(embeds[:, :1]), embeds[:, 1:]], axis=1)
        mask = create_attention_mask(embeds, cache[0])
        return self.layer(embeds, hidden, mask, cache[0])

    def logits(self, out: mx.array) -> mx.array:
        h = self.layer.final_layernorm(out)
        if getattr(self.target.args, "tie_word_embeddings", False):
            return self.target.model.embed_tokens.as_linear(h)
        return self.target.lm_head(h)


def attach_mtp(model: nn.Module, model_dir: Path, config: dict[str, Any]) -> None:
    """Keep the checkpoint's MTP layers on ``model.mtp_layers`` (a list, outside its parameters)
    when its architecture has a known MTP layout and the weights are there; else do nothing.

    Raises:
        CorruptModelError: the MTP weights are incomplete or misshapen.
    """
    layout = MTP_LAYOUTS.get(str(config.get("model_type")))
    count = int(config.get("num_nextn_predict_layers") or 0)
    if layout is None or count == 0:
        return
    prefix, layer_class = layout
    found: dict[str, mx.array] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        found.update({k[len(prefix):]: v for k, v in mx.load(str(path)).items()
                      if k.startswith(prefix)})
    if not found:
        return  # a checkpoint saved without them (mlx-lm's own conversions drop them)
    layers = []
    for i in range(count):
        layer = layer_class(model.args)
        own = [(k.split(".", 1)[1], v) for k, v in found.items() if k.split(".", 1)[0] == str(i)]
        try:
            layer.load_weights(own)
        except ValueError as e:
            raise CorruptModelError(f"{model_dir}: the MTP layer {i}'s weights do not fit "
                                    f"({str(e).splitlines()[0]})") from e
        mx.eval(layer.parameters())
        layers.append(layer)
    object.__setattr__(model, "mtp_layers", layers)


def mtp_head(model: nn.Module) -> MTPHead:
    """The MTP head of a model loaded with its MTP layers (``attach_mtp``).

    Raises:
        UnsupportedModelError: the model carries no MTP layers mlxspec can run.
    """
    layers = getattr(model, "mtp_layers", None)
    if not layers:
        model_type = getattr(getattr(model, "args", None), "model_type", "?")
        raise UnsupportedModelError(
            f"this model ({model_type}) carries no MTP layers mlxspec can run (supported: "
            f"{', '.join(MTP_LAYOUTS)} checkpoints with num_nextn_predict_layers > 0): use "
            "--draft auto, a head directory, or --prompt-lookup")
    return MTPHead(model, layers)
