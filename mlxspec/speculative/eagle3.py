"""EAGLE-3 draft heads (Li et al. 2025, arXiv 2503.01840) in the layout published heads use.

The layout is SpecForge's / vLLM's ``LlamaForCausalLMEagle3`` (``llama_eagle3.py`` in both):

- ``config.json``: a llama config with ``num_hidden_layers: 1``, ``hidden_size`` (the head's
  width), ``vocab_size`` (the target's), ``draft_vocab_size`` (the head's reduced vocabulary),
  optional ``target_hidden_size`` (the target's width when it differs),
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the target's tapped layers; vLLM's default
  ``(2, L // 2, L - 3)`` when absent), ``norm_before_residual`` and ``logit_scale``. vLLM's
  speculators layout (``transformer_layer_config`` + top-level
  ``eagle_aux_hidden_state_layer_ids``) is read too.
- weights (safetensors): ``fc.weight`` (H, 3 * H_target) fuses the three taps; the decoder
  layer ``midlayer.*`` (``layers.0.*`` in speculators files) whose attention reads
  ``[input_layernorm(embed(token)), hidden_norm(hidden)]`` (2H wide); ``norm.weight``;
  ``lm_head.weight`` (draft_vocab, H); ``d2t`` (draft_vocab,) int64 offsets, target id =
  draft id + d2t[draft id]; ``t2d`` (vocab,) bool (ignored: d2t says it all); optional
  ``embed_tokens.weight`` (else the target's embedding is shared, as vLLM does).

Tap id j is the hidden state *entering* layer j of the target (0: the embedding; vLLM's
convention). Position p of the head's cache holds (target features at p, token p + 1); the output
there predicts token p + 2. A chained step feeds the head's own pre-norm output instead of
``fc(features)`` (H wide, no fc), exactly as vLLM's ``combine_hidden_states`` distinguishes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.llama import MLP, Attention, ModelArgs

from mlxspec.errors import (
    CorruptModelError,
    ModelNotFoundError,
    TokenizerMismatchError,
    UnsupportedModelError,
)

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def default_taps(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 taps for a target of ``num_layers`` layers (low, mid, high); a
    target of fewer than 6 layers (test models) taps the embedding, the middle and the end."""
    if num_layers < 6:
        return [0, num_layers // 2, num_layers]
    return [2, num_layers // 2, num_layers - 3]


@dataclass
class Eagle3Config:
    """What a head needs to be built; ``taps`` None means ``default_taps`` of the target."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    norm_before_residual: bool = False
    logit_scale: float = 1.0  # vLLM's: the draft logits are multiplied by it
    taps: list[int] | None = None
    extra: dict = field(default_factory=dict)  # mlxspec's own fields (target, tokenizer, card)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Eagle3Config:
        """Read a SpecForge/vLLM ``LlamaForCausalLMEagle3`` or speculators ``Eagle3Speculator``
        config. Raises ``CorruptModelError`` for a missing field, ``UnsupportedModelError`` for a
        head of more than one layer."""
        layer = {**config, **config.get("transformer_layer_config", {})}
        eagle = config.get("eagle_config") or {}
        taps = eagle.get("eagle_aux_hidden_state_layer_ids") or config.get(
            "eagle_aux_hidden_state_layer_ids")
        if layer.get("num_hidden_layers", 1) != 1:
            raise UnsupportedModelError(
                f"the EAGLE-3 head has {layer['num_hidden_layers']} layers; mlxspec runs "
                "one-layer heads (the published layout)")
        if eagle.get("use_aux_hidden_state") is False:
            raise UnsupportedModelError("the head does not use the target's layer features "
                                        "(use_aux_hidden_state false): not an EAGLE-3 head")
        try:
            hidden = int(layer["hidden_size"])
            return cls(
                hidden_size=hidden, intermediate_size=int(layer["intermediate_size"]),
                num_attention_heads=int(layer["num_attention_heads"]),
                num_key_value_heads=int(layer.get("num_key_value_heads",
                                                  layer["num_attention_heads"])),
                vocab_size=int(layer.get("target_vocab_size", layer["vocab_size"])),
                draft_vocab_size=int(config.get("draft_vocab_size") or layer["vocab_size"]),
                target_hidden_size=int(config.get("target_hidden_size") or hidden),
                head_dim=layer.get("head_dim"), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-5)),
                rope_theta=float(layer.get("rope_theta", 10000.0)),
                rope_scaling=layer.get("rope_scaling"),
                max_position_embeddings=int(layer.get("max_position_embeddings", 8192)),
                attention_bias=bool(layer.get("attention_bias", False)),
                norm_before_residual=bool(config.get("norm_before_residual", False)),
                logit_scale=float(config.get("logit_scale", 1.0)),
                taps=[int(t) for t in taps] if taps else None,
                extra=dict(config.get("mlxspec", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptModelError(f"the EAGLE-3 head's config.json lacks a valid {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """The config in the ``LlamaForCausalLMEagle3`` layout (what vLLM and SGLang read)."""
        config = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "num_hidden_layers": 1, "hidden_act": "silu", "tie_word_embeddings": False,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "norm_before_residual": self.norm_before_residual,
            "eagle_config": {"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": self.taps},
            "torch_dtype": "float16",
        }
        if self.head_dim is not None:
            config["head_dim"] = self.head_dim
        if self.logit_scale != 1.0:
            config["logit_scale"] = self.logit_scale
        if self.extra:
            config["mlxspec"] = self.extra
        return config

    def layer_args(self) -> ModelArgs:
        return ModelArgs(
            model_type="llama", hidden_size=self.hidden_size, num_hidden_layers=1,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size, head_dim=self.head_dim,
            num_key_value_heads=self.num_key_value_heads, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias)


class MidLayer(nn.Module):
    """The head's decoder layer: attention over [normed embedding, normed hidden] (2H -> H)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        args, wide = config.layer_args(), 2 * config.hidden_size
        self.self_attn = Attention(args)
        attn = self.self_attn
        bias = config.attention_bias
        attn.q_proj = nn.Linear(wide, attn.n_heads * attn.head_dim, bias=bias)
        attn.k_proj = nn.Linear(wide, attn.n_kv_heads * attn.head_dim, bias=bias)
        attn.v_proj = nn.Linear(wide, attn.n_kv_heads * attn.head_dim, bias=bias)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_before_residual = config.norm_before_residual

    def inputs(self, embeds: mx.array, hidden: mx.array) -> tuple[mx.array, mx.array]:
        """(attention input (..., 2H), residual (..., H)) as vLLM's first-layer convention."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return mx.concatenate([self.input_layernorm(embeds), normed], axis=-1), residual

    def finish(self, attended: mx.array, residual: mx.array) -> mx.array:
        """The pre-norm output after attention: residual adds and the MLP."""
        h = residual + attended
        return h + self.mlp(self.post_attention_layernorm(h))

    def __call__(self, embeds: mx.array, hidden: mx.array, mask: Any, cache: Any) -> mx.array:
        x, residual = self.inputs(embeds, hidden)
        return self.finish(self.self_attn(x, mask, cache), residual)


class Eagle3Head(nn.Module):
    """An EAGLE-3 head. ``embed`` is the target's embedding unless the checkpoint has its own.

    Shapes: features (B, T, 3 * H_target); tokens (B, T) uint32; hidden (B, T, H).
    """

    def __init__(self, config: Eagle3Config, embed: nn.Module):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.d2t = mx.zeros((config.draft_vocab_size,), mx.int32)
        self.freeze(recurse=False, keys=["d2t"])  # a map, not a weight
        self.share_embedding(embed)

    def share_embedding(self, embed: nn.Module) -> None:
        """Embed tokens with ``embed`` (the target's), kept out of the head's parameters."""
        object.__setattr__(self, "embed", embed)

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype the head computes in (its norm's weight: its linear layers may be packed)."""
        return self.norm.weight.dtype

    def draft_ids(self) -> mx.array:
        """(draft_vocab,) target token id of each draft token."""
        return mx.arange(self.config.draft_vocab_size, dtype=mx.int32) + self.d2t

    def step(self, tokens: mx.array, hidden: mx.array, cache: Any, features: bool) -> mx.array:
        """Pre-norm outputs (B, T, H) for ``tokens`` after ``hidden``, into ``cache`` (a list
        of one KV cache).

        ``features``: ``hidden`` is the target's fused taps (B, T, 3 * H_target), which go
        through fc; else it is the head's own pre-norm output (B, T, H) of a chained step.
        """
        if features:
            hidden = self.fc(hidden)
        embeds = self.embed(tokens).astype(hidden.dtype)
        mask = create_attention_mask(embeds, cache[0])
        return self.midlayer(embeds, hidden, mask, cache[0])

    def logits(self, out: mx.array) -> mx.array:
        """Draft-vocabulary logits (..., draft_vocab) of pre-norm outputs (..., H)."""
        logits = self.lm_head(self.norm(out))
        return logits if self.config.logit_scale == 1.0 else logits * self.config.logit_scale


def save_eagle3(head: Eagle3Head, directory: Path, dtype: mx.Dtype = mx.float16) -> None:
    """Write ``config.json`` and ``model.safetensors`` (``d2t`` int64, ``t2d`` bool) into
    ``directory`` (created; an existing head there is overwritten file by file)."""
    from mlx.utils import tree_flatten

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in tree_flatten(head.parameters()) if k != "d2t"}
    draft_ids = head.draft_ids()
    weights["d2t"] = head.d2t.astype(mx.int64)
    t2d = mx.zeros((head.config.vocab_size,), mx.bool_)
    t2d[draft_ids] = True
    weights["t2d"] = t2d
    mx.save_safetensors(str(directory / WEIGHTS), weights, metadata={"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")


def read_weights(directory: Path) -> dict[str, mx.array]:
    """The head's tensors (every ``*.safetensors`` file), with speculators' names mapped."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in Path(directory).glob("*.bin")] + \
            [p.name for p in Path(directory).glob("*.pt")]
        hint = f" (only {', '.join(pickles)}: convert it to safetensors)" if pickles else ""
        raise CorruptModelError(f"no .safetensors weights in the EAGLE-3 head {directory}{hint}")
    weights: dict[str, mx.array] = {}
    for path in files:
        try:
            weights.update(mx.load(str(path)))
        except Exception as e:  # MLX raises a bare RuntimeError/ValueError for a damaged file
            raise CorruptModelError(f"cannot read {path}: {str(e).splitlines()[0]}") from e
    return {k.replace("layers.0.", "midlayer.").removeprefix("model."): v
            for k, v in weights.items()}


def target_shape(model: nn.Module) -> tuple[int, int, int]:
    """(hidden size, layers, embedding rows) of a target model."""
    inner = model.model
    rows = inner.embed_tokens.weight.shape[0]
    return int(model.args.hidden_size), len(inner.layers), int(rows)


def load_head(spec: str | Path, model: nn.Module, tokenizer: Any) -> Eagle3Head:
    """An EAGLE-3 head from a local directory or a Hub id, checked against the target.

    Raises:
        UnsupportedModelError: the head's hidden size or taps do not fit the target.
        TokenizerMismatchError: its vocabulary (or tokenizer, when it names or ships one) is not
            the target's.
        CorruptModelError: a config field or a weight is missing, misshapen or unreadable.
    """
    from mlxspec.load import resolve_model_path
    from mlxspec.speculative.tokenizers import check_same_tokenizer, tokenizer_fingerprint

    try:
        directory = resolve_model_path(str(spec))
    except ModelNotFoundError as e:
        raise ModelNotFoundError(
            f"no draft head at {spec}: give a head's directory or Hub id, 'auto', 'mtp' or "
            "'none' (--draft)") from e
    try:
        raw = json.loads((directory / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise CorruptModelError(f"cannot read the EAGLE-3 head's {directory / CONFIG}: {e}") from e
    config = Eagle3Config.from_dict(raw)
    hidden, layers, rows = target_shape(model)
    config.taps = config.taps or default_taps(layers)
    if config.target_hidden_size != hidden:
        raise UnsupportedModelError(
            f"the EAGLE-3 head reads hidden states of width {config.target_hidden_size}, the "
            f"target's are {hidden}: use a head trained for this model")
    if len(config.taps) != 3 or not all(0 <= t <= layers for t in config.taps):
        raise UnsupportedModelError(
            f"the EAGLE-3 head taps layers {config.taps}, the target has {layers}: use a head "
            "trained for this model")
    if config.vocab_size != rows or config.draft_vocab_size > rows:
        raise TokenizerMismatchError(
            f"the EAGLE-3 head's vocabulary ({config.vocab_size} tokens) is not the target's "
            f"({rows}): use a head trained for this model")
    fingerprint = config.extra.get("tokenizer_sha256")
    if fingerprint and fingerprint != tokenizer_fingerprint(tokenizer):
        raise TokenizerMismatchError(
            f"the EAGLE-3 head was trained for another tokenizer "
            f"({config.extra.get('target', 'unknown target')}): use a head trained for this model")
    if (directory / "tokenizer.json").exists():
        from mlxspec.load import read_tokenizer

        check_same_tokenizer(tokenizer, read_tokenizer(directory, raw), "the EAGLE-3 head")
    weights = read_weights(directory)
    head = Eagle3Head(config, model.model.embed_tokens)
    _check_weights(head, weights, directory)
    if "embed_tokens.weight" in weights:  # the head's own embedding
        own = nn.Embedding(*weights["embed_tokens.weight"].shape)
        own.weight = weights.pop("embed_tokens.weight")
        head.share_embedding(own)
    if "d2t" in weights:
        weights["d2t"] = weights["d2t"].astype(mx.int32)
    elif config.draft_vocab_size != config.vocab_size:
        raise CorruptModelError(f"the EAGLE-3 head {directory} has a reduced vocabulary but no d2t")
    weights.pop("t2d", None)
    head.load_weights(list(weights.items()), strict=False)
    ids = head.draft_ids().tolist()
    if min(ids) < 0 or max(ids) >= rows or len(set(ids)) != len(ids):
        raise CorruptModelError(f"the EAGLE-3 head's d2t maps draft ids outside the vocabulary "
                                f"({directory})")
    # Compute in the target's activation dtype (the features arrive in it): on a float32 CPU
    # target a float16 head step took 12.4 ms against 1.8 ms in float32 (MLX's CPU has no fast
    # float16 matmul; the target's step: 40 ms, 2-core Xeon), and float16 storage stays small.
    dtype = activation_dtype(model)
    head.update(tree_map(lambda w: w.astype(dtype) if mx.issubdtype(w.dtype, mx.floating) else w,
                         head.parameters()))
    mx.eval(head.parameters())
    return head


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of the target's residual stream (its embedding's output, quantized or not)."""
    return model.model.embed_tokens(mx.array([0])).dtype


def _check_weights(head: Eagle3Head, weights: dict[str, mx.array], directory: Path) -> None:
    from mlx.utils import tree_flatten

    for name, param in tree_flatten(head.parameters()):
        if name == "d2t":
            continue
        if name not in weights:
            raise CorruptModelError(f"the EAGLE-3 head {directory} lacks the weight {name}")
        if tuple(weights[name].shape) != tuple(param.shape):
            raise CorruptModelError(
                f"the EAGLE-3 head's {name} is {tuple(weights[name].shape)}, its config says "
                f"{tuple(param.shape)} ({directory})")
    if "d2t" in weights and tuple(weights["d2t"].shape) != (head.config.draft_vocab_size,):
        raise CorruptModelError(f"the EAGLE-3 head's d2t has shape {tuple(weights['d2t'].shape)},"
                                f" not ({head.config.draft_vocab_size},) ({directory})")
