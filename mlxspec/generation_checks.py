"""The generation API's boundary: arguments, prompts and the model's context are checked here,
before any work, with one-line ``InvalidArgumentError`` messages naming the fix."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlxspec.errors import InvalidArgumentError


def embedding_rows(model: nn.Module) -> int | None:
    """Rows of the model's input embedding (valid token ids are below it), None if not found."""
    embeddings = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))]
    embeddings.sort(key=lambda item: not item[0].endswith("embed_tokens"))  # the token embedding
    for _, module in embeddings[:1]:
        if isinstance(module, nn.QuantizedEmbedding):
            return int(module.num_embeddings)
        return int(module.weight.shape[0])
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(vocab) if vocab else None


def context_length(model: nn.Module) -> int | None:
    """The model's context (``max_position_embeddings``), None if it does not say."""
    args = getattr(model, "args", None)
    value = getattr(args, "max_position_embeddings", None)
    if value is None:
        value = getattr(getattr(args, "text_config", None), "max_position_embeddings", None)
    if value is None and isinstance(getattr(args, "text_config", None), dict):
        value = args.text_config.get("max_position_embeddings")
    return int(value) if value else None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_generation_arguments(
    *, max_tokens: object, num_draft_tokens: object, prefill_step_size: object,
    kv_bits: object, kv_group_size: object, max_kv_size: object, min_confidence: object = 0.0,
) -> None:
    """Raise ``InvalidArgumentError`` (one line naming the fix) for an out-of-range argument."""
    if not _is_int(max_tokens) or max_tokens < 1:
        raise InvalidArgumentError(f"max_tokens={max_tokens!r}: use a whole number >= 1")
    if num_draft_tokens != "auto" and (not _is_int(num_draft_tokens) or num_draft_tokens < 1):
        raise InvalidArgumentError(
            f"num_draft_tokens={num_draft_tokens!r}: use 'auto' or a whole number >= 1"
        )
    if not _is_int(prefill_step_size) or prefill_step_size < 1:
        raise InvalidArgumentError(
            f"prefill_step_size={prefill_step_size!r}: use a whole number >= 1"
        )
    if kv_bits is not None and kv_bits not in (2, 3, 4, 5, 6, 8):
        raise InvalidArgumentError(f"kv_bits={kv_bits!r}: use 2, 3, 4, 5, 6 or 8 (None is off)")
    if kv_group_size not in (32, 64, 128):
        raise InvalidArgumentError(f"kv_group_size={kv_group_size!r}: use 32, 64 or 128")
    if max_kv_size is not None and (not _is_int(max_kv_size) or max_kv_size < 16):
        raise InvalidArgumentError(f"max_kv_size={max_kv_size!r}: use a whole number >= 16")
    if kv_bits is not None and max_kv_size is not None:
        raise InvalidArgumentError(
            "kv_bits and max_kv_size together are not supported (mlx-lm cannot quantize a "
            "rotating cache): choose one"
        )
    if not isinstance(min_confidence, (int, float)) or not 0 <= min_confidence < 1:
        raise InvalidArgumentError(f"draft_min_confidence={min_confidence!r}: use a number in [0, 1)")


def encode_prompt(
    tokenizer: TokenizerWrapper, prompt: str | Sequence[int] | mx.array, model: nn.Module | None = None
) -> mx.array:
    """Token ids (seq,) int32 for a prompt string or ids; adds BOS the way mlx-lm does.

    Raises ``InvalidArgumentError`` for an empty prompt, text that is not valid Unicode, or ids
    outside the model's embedding (they would read out of bounds).
    """
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidArgumentError(
                f"the prompt is not valid UTF-8 text (at character {e.start}): fix its encoding"
            ) from None
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    ids = prompt.astype(mx.int32) if isinstance(prompt, mx.array) else None
    if ids is None:
        values = list(prompt)
        if not all(isinstance(t, numbers.Integral) for t in values):
            raise InvalidArgumentError("prompt token ids must be whole numbers")
        values = [int(t) for t in values]
        if values and (min(values) < -(2**31) or max(values) >= 2**31):
            raise InvalidArgumentError(
                f"token id {max(values, key=abs)} is out of range: use ids of this tokenizer"
            )
        ids = mx.array(values, dtype=mx.int32)
    if ids.ndim != 1 or ids.size == 0:
        raise InvalidArgumentError("the prompt is empty: give some text or token ids")
    rows = embedding_rows(model) if model is not None else None
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (rows is not None and hi >= rows):
        bad = lo if lo < 0 else hi
        raise InvalidArgumentError(
            f"token id {bad} is outside the model's vocabulary (0..{(rows or 1) - 1}): use ids "
            "from this model's tokenizer"
        )
    return ids


def check_context(model: nn.Module, held: int, prompt_tokens: int, max_tokens: int) -> None:
    """Raise ``InvalidArgumentError`` if the cache's ``held`` tokens + the prompt + max_tokens
    exceed the model's context (only called without a ``max_kv_size`` window)."""
    context = context_length(model)
    if context is not None and held + prompt_tokens + max_tokens > context:
        raise InvalidArgumentError(
            f"the prompt ({held + prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"model's context of {context} tokens: shorten the prompt, lower max_tokens, or pass "
            "max_kv_size for a sliding window"
        )
