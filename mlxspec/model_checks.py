"""Checks that a model directory's files make sense before anything is built from them.

A hostile or broken ``config.json`` (a list, ``"hidden_size": "abc"``, no ``model_type``) makes
mlx-lm fail deep inside a model constructor with a traceback, and a tokenizer whose ids run past
the embedding's rows loads fine and then reads out of bounds. These checks turn both into one
clear ``CorruptModelError`` naming the file, the field and the fix. This module is a leaf: it
imports nothing from mlxspec but the errors.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mlxspec.errors import CorruptModelError

# Fields mlx-lm's model classes read as sizes; when present (and not null) they must be
# positive integers. intermediate_size may also be a per-layer list.
POSITIVE_INTS = (
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim",
    "num_local_experts", "num_experts_per_tok",
)
POSITIVE_NUMBERS = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "rope_theta")
# (pad_token_id is left alone: old Llama configs set it to -1.)
TOKEN_IDS = ("eos_token_id", "bos_token_id")
QUANTIZATION_KEYS = ("quantization", "quantization_config")


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def is_int(value: Any) -> bool:
    """An integer, not a bool (JSON and GGUF readers give both)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(value: Any) -> bool:
    return is_int(value) and value > 0


def _problem(config: Any) -> str | None:
    """What is wrong with a parsed config.json, or None."""
    if not isinstance(config, dict):
        return f"it is a JSON {_kind(config)}, not an object"
    if not isinstance(config.get("model_type"), str) or not config["model_type"].strip():
        return "it has no \"model_type\" string (which architecture to build)"
    for key in POSITIVE_INTS:
        value = config.get(key)
        if value is None:
            continue
        values = value if key == "intermediate_size" and isinstance(value, list) else [value]
        if not values or not all(_positive_int(v) for v in values):
            return f"\"{key}\" must be a positive integer, not {value!r}"
    for key in POSITIVE_NUMBERS:
        value = config.get(key)
        if value is not None and not (is_number(value) and value > 0):
            return f"\"{key}\" must be a positive number, not {value!r}"
    for key in TOKEN_IDS:
        value = config.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(is_int(i) and i >= 0 for i in ids):
            return f"\"{key}\" must be a token id (an integer >= 0) or a list of them, not {value!r}"
    if "text_config" in config and not isinstance(config["text_config"], dict | type(None)):
        return f"\"text_config\" must be an object, not a {_kind(config['text_config'])}"
    for key in QUANTIZATION_KEYS:
        if key in config and config[key] is not None:
            problem = _quantization_problem(key, config[key])
            if problem:
                return problem
    return None


def _quantization_problem(key: str, q: Any) -> str | None:
    if not isinstance(q, dict):
        return f"\"{key}\" must be an object, not a {_kind(q)}"
    if key == "quantization":  # mlx-lm's own record (quantization_config's GPTQ uses -1 groups)
        for field in ("bits", "group_size"):
            if field in q and not _positive_int(q[field]):
                return f"\"{key}.{field}\" must be a positive integer, not {q[field]!r}"
        for name, layer in q.items():
            if isinstance(layer, dict):
                for field in ("bits", "group_size"):
                    if field in layer and not _positive_int(layer[field]):
                        return (f"\"{key}.{name}.{field}\" must be a positive integer, "
                                f"not {layer[field]!r}")
    return None


def check_config(config: Any, path: Path | str) -> dict[str, Any]:
    """``config`` (parsed from ``path``) if it is a usable model config, else CorruptModelError
    naming the bad field."""
    problem = _problem(config)
    if problem:
        raise CorruptModelError(f"{path} is not a valid model config: {problem}; fix or "
                                "re-download the model")
    return config


def embedding_rows(model) -> int | None:
    """Rows of the model's input embedding table (the largest valid token id + 1), or None
    when the model has no recognisable embedding."""
    import mlx.nn as nn

    embeddings = [
        (name, m) for name, m in model.named_modules()
        if isinstance(m, nn.Embedding | nn.QuantizedEmbedding)
    ]
    embeddings.sort(key=lambda item: not item[0].endswith("embed_tokens"))
    if embeddings:
        return int(embeddings[0][1].weight.shape[0])
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def tokenizer_ids(tokenizer) -> int:
    """Number of ids the tokenizer can produce: its largest id + 1, added tokens included."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper wraps HF's
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: no 262k-entry dict needed
        added = backend.get_added_tokens_decoder()
        return max(backend.get_vocab_size(with_added_tokens=False), max(added, default=-1) + 1)
    vocab = hf.get_vocab()
    return max(vocab.values()) + 1 if vocab else 0


def check_vocabulary(model, tokenizer, config: dict[str, Any], where: Path | str) -> None:
    """CorruptModelError if the tokenizer (added tokens included) or the config's special ids
    can produce an id past the model's embedding rows: such ids would read out of bounds."""
    rows = embedding_rows(model)
    if rows is None:
        return
    n_ids = tokenizer_ids(tokenizer)
    if n_ids > rows:
        raise CorruptModelError(
            f"the tokenizer of {where} produces ids up to {n_ids - 1}, but the embedding has "
            f"only {rows} rows: the tokenizer does not belong to these weights"
        )
    for key in TOKEN_IDS:
        value = config.get(key)
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id >= rows:
                raise CorruptModelError(
                    f"{where}: config.json's {key} {token_id} is past the embedding's {rows} "
                    "rows; fix config.json"
                )
