"""Which feature draft a target gets: a head by path or Hub id, or the one shipped for it.

Heads shipped with mlxspec live in ``mlxspec.recipes.drafts`` (the repository's ``models/drafts``),
one directory each in the EAGLE-3 layout. ``--draft auto`` picks the shipped head trained for the
target: same tokenizer (fingerprint), same hidden size, layers and vocabulary; otherwise there
is no automatic feature draft (None).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxspec import cpu
from mlxspec.errors import MlxspecError
from mlxspec.speculative.eagle3 import CONFIG, load_head, target_shape
from mlxspec.speculative.feature import FeatureDrafter
from mlxspec.speculative.mtp import mtp_head


@dataclass(frozen=True)
class FeatureDraft:
    """A feature draft asked for by name (``--draft auto`` / a head's directory or Hub id):
    passed as ``draft_model``, ``make_drafter`` builds it for its target."""

    spec: str = "auto"


def shipped_heads() -> list[Path]:
    """Directories of the heads shipped with mlxspec."""
    try:
        root = Path(str(resources.files("mlxspec.recipes") / "drafts"))
    except ModuleNotFoundError:
        return []
    return sorted(p for p in root.glob("*") if (p / CONFIG).is_file()) if root.is_dir() else []


def shipped_head_for(model: nn.Module, tokenizer: Any) -> Path | None:
    """The shipped head trained for this target (tokenizer and shapes), or None."""
    from mlxspec.speculative.tokenizers import tokenizer_fingerprint

    hidden, layers, rows = target_shape(model)
    fingerprint = tokenizer_fingerprint(tokenizer)
    for path in shipped_heads():
        config = json.loads((path / CONFIG).read_text())
        extra = config.get("mlxspec", {})
        if (extra.get("tokenizer_sha256") == fingerprint and config.get("vocab_size") == rows
                and config.get("target_hidden_size") == hidden
                and extra.get("target_layers", layers) == layers):
            return path
    return None


# The head of a quantized target is quantized too (see quantize_head).
HEAD_BITS, HEAD_GROUP_SIZE = 8, 64


def quantized_target(model: nn.Module) -> bool:
    """Whether the target's linear weights are quantized (packed integers)."""
    return any(isinstance(getattr(m, "bits", None), int) and "weight" in m
               and m["weight"].dtype == mx.uint32 for _, m in model.named_modules())


def quantize_head(head: nn.Module, model: nn.Module) -> bool:
    """Quantize the head's linear layers to 8 bits (groups of 64) when the target's weights are
    quantized; returns whether it did (a float target keeps a float head).

    A draft pays only while its step is a small part of a target step, and both stream their
    weights from memory: the shipped float32 head reads 30 MB a step beside the 4-bit default
    model's 99 MB. On the default model (2-core Xeon, loaded) its step in the decoding loop took
    4.8 ms in float32, 3.0 at 8 bits, 2.2 at 4 bits, and its first draft matched the target's
    next token 32.0 / 31.5 / 29.9 % of the time over 400 answer tokens: 8 bits keeps the head's
    predictions. The verification keeps the output the target's whatever the draft computes.
    """
    if not quantized_target(model):
        return False
    pack_head(head)
    return True


def pack_head(head: nn.Module) -> None:
    """The head's linear layers to HEAD_BITS (groups of HEAD_GROUP_SIZE), in place."""
    nn.quantize(head, group_size=HEAD_GROUP_SIZE, bits=HEAD_BITS,
                class_predicate=lambda _, m: isinstance(m, nn.Linear)
                and m.weight.shape[-1] % HEAD_GROUP_SIZE == 0)
    cpu.prepare(head)  # on a CPU: the packed-weight kernel for the new layers


def make_feature_drafter(spec: str | Path, model: nn.Module, tokenizer: Any) -> FeatureDrafter | None:
    """A feature drafter for ``model``: ``spec`` is ``"auto"`` (the shipped head for this
    target, or None when there is none or it cannot run on this architecture) or a head's
    directory / Hub id, or ``"mtp"``: the checkpoint's own multi-token-prediction layers
    (``mlxspec.speculative.mtp``; UnsupportedModelError when the model has none).

    Raises:
        MlxspecError subclasses (one line each) for a head that does not fit the target.
    """
    vocab = int(target_shape(model)[2])
    if spec == "auto":
        path = shipped_head_for(model, tokenizer)
        if path is None:
            return None
        try:
            head = load_head(path, model, tokenizer)
        except MlxspecError:
            return None
        quantize_head(head, model)
        return FeatureDrafter(head, model, vocab_size=vocab)
    if spec == "mtp":  # the checkpoint's own MTP layers, kept at load (mlxspec.speculative.mtp)
        return FeatureDrafter(mtp_head(model), model, vocab_size=vocab)
    head = load_head(spec, model, tokenizer)
    quantize_head(head, model)
    return FeatureDrafter(head, model, vocab_size=vocab)
