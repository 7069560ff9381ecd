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

import mlx.nn as nn

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
            return FeatureDrafter(load_head(path, model, tokenizer), model, vocab_size=vocab)
        except MlxspecError:
            return None
    if spec == "mtp":  # the checkpoint's own MTP layers, kept at load (mlxspec.speculative.mtp)
        return FeatureDrafter(mtp_head(model), model, vocab_size=vocab)
    return FeatureDrafter(load_head(spec, model, tokenizer), model, vocab_size=vocab)
