"""The "same tokenizer" rule: one home for it (speculative drafts, evaluation references)."""

from __future__ import annotations

from typing import Any

from mlx_lm.utils import common_prefix_len

from mlxspec.errors import TokenizerMismatchError


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


def check_same_tokenizer(tokenizer: Any, other_tokenizer: Any, what: str = "the draft model") -> None:
    """Raise ``TokenizerMismatchError`` unless ``other_tokenizer`` tokenizes exactly like
    ``tokenizer``.

    Token -> id must agree on the ids both tokenizers have, and BOS, EOS, PAD and the special
    (chat template) tokens must be the same. Different vocabulary lengths are allowed (embedding
    matrices padded to different sizes); ids only one side has are never produced by text both
    share. ``what`` names the other model in the message ("the draft model", "the reference
    model").
    """
    target, other = _tokens_by_id(tokenizer), _tokens_by_id(other_tokenizer)
    shared = min(len(target), len(other))
    if target[:shared] != other[:shared]:
        i = common_prefix_len(target[:shared], other[:shared])
        raise TokenizerMismatchError(
            f"{what}'s tokenizer differs from the model's: token id {i} is {target[i]!r} for the "
            f"model but {other[i]!r} for {what}; use a model of the same family (same tokenizer)"
        )
    expected, got = _special_tokens(tokenizer), _special_tokens(other_tokenizer)
    for kind, value in expected.items():
        if got[kind] != value:
            raise TokenizerMismatchError(
                f"{what}'s tokenizer has different {kind} ({got[kind]!r}, the model's are "
                f"{value!r}); use a model of the same family (same tokenizer)"
            )


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of the token -> id table and the special tokens (what a head records it was
    trained with; equal fingerprints tokenize alike)."""
    import hashlib
    import json

    table = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    payload = json.dumps([table, _special_tokens(tokenizer)], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()
