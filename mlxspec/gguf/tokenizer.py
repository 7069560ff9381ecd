"""Rebuild a Hugging Face ``tokenizers`` tokenizer from a GGUF file's metadata.

``tokenizer.ggml.model = gpt2`` is byte-level BPE with the file's merges and the pre-tokenizer
regexes llama.cpp uses for ``tokenizer.ggml.pre``; ``= llama`` is SentencePiece-style BPE with byte
fallback, its merges derived from the token scores (what llama.cpp's SPM tokenizer merges by).
Control tokens become special added tokens and user-defined tokens plain added tokens, matched
whole in the raw text as llama.cpp does.
"""

from __future__ import annotations

from typing import Any

from mlxspec.errors import CorruptModelError, UnsupportedModelError

# llama.cpp token types (llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# End-of-generation tokens llama.cpp recognises by name, besides the declared eos/eot/eom ids.
_END_OF_GENERATION = {
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
}

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regexes llama.cpp splits text with, in order (llama-vocab.cpp).
PRE_TOKENIZER_SPLITS = {
    "default": [_GPT2_SPLIT],
    "gpt-2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "refact": [r"\p{N}", _GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "llama-v3": [_LLAMA3_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT],
}
# Pre-tokenizers whose words that are whole tokens skip the merges (llama.cpp's ignore_merges).
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe"}


# Metadata keys holding token ids: each must name a token of the vocabulary.
TOKEN_ID_KEYS = tuple(
    f"tokenizer.ggml.{k}_token_id"
    for k in ("bos", "eos", "eot", "eom", "unknown", "padding", "seperator", "mask")
)


def check_tokenizer_metadata(meta: dict, rows: int) -> None:
    """CorruptModelError unless the tokenizer metadata is well-formed: a list of distinct-type
    strings no longer than the embedding's ``rows``, parallel lists of matching lengths, merges
    as strings, and every special token id inside the vocabulary."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if "tokenizer.huggingface.json" in meta:
        if not isinstance(meta["tokenizer.huggingface.json"], str):
            raise CorruptModelError("GGUF tokenizer.huggingface.json is not a string")
    elif not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise CorruptModelError("GGUF tokenizer.ggml.tokens is missing or not a list of strings")
    n = len(tokens) if isinstance(tokens, list) else rows
    if n > rows:
        raise CorruptModelError(
            f"GGUF vocabulary has {n} tokens but the embedding only {rows} rows: ids past "
            f"{rows - 1} would read out of bounds"
        )
    for key, kind in (("token_type", int), ("scores", (int, float))):
        values = meta.get(f"tokenizer.ggml.{key}")
        if values is not None and (
            not isinstance(values, list) or len(values) != n
            or not all(isinstance(v, kind) and not isinstance(v, bool) for v in values)
        ):
            raise CorruptModelError(
                f"GGUF tokenizer.ggml.{key} is not a list of {n} numbers (one per token)"
            )
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and not (
        isinstance(merges, list) and all(isinstance(m, str) and " " in m for m in merges)
    ):
        raise CorruptModelError("GGUF tokenizer.ggml.merges is not a list of 'a b' strings")
    for key in TOKEN_ID_KEYS:
        value = meta.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n:
            raise CorruptModelError(
                f"GGUF {key} is {value!r}, outside the vocabulary of {n} tokens"
            )
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if key in meta and not isinstance(meta[key], str):
            raise CorruptModelError(f"GGUF {key} is not a string")


def _token_list(meta: dict) -> list[str]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CorruptModelError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if len(set(tokens)) != len(tokens):
        raise UnsupportedModelError("GGUF vocabulary has duplicate token strings")
    return tokens


def _token_types(meta: dict) -> list[int]:
    return meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(meta["tokenizer.ggml.tokens"])


def _byte_level_bpe(meta: dict, tokens: list[str]):
    """GPT-2 style byte-level BPE (``tokenizer.ggml.model = gpt2``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(PRE_TOKENIZER_SPLITS)})"
        )
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
    splits = [
        pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]
    ]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple]:
    """BPE merges equivalent to SentencePiece's rule "merge the adjacent pair whose joined piece
    scores highest": every split (a, b) of a normal token, ranked by the joined token's score."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    merges = []
    for i in sorted(ids.values(), key=lambda i: (-scores[i], i)):
        token = tokens[i]
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        splits = [(ids[a], ids[b], a, b) for a, b in splits if a in ids and b in ids]
        merges.extend((a, b) for _, _, a, b in sorted(splits))
    return merges


def _sentencepiece_bpe(meta: dict, tokens: list[str]):
    """SentencePiece BPE with byte fallback (``tokenizer.ggml.model = llama``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise CorruptModelError("GGUF SentencePiece vocabulary has neither merges nor scores")
        merges = sentencepiece_merges(tokens, scores, _token_types(meta))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = None if unk_id is None else tokens[unk_id]
    tokenizer = Tokenizer(
        models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)  # the shape mlx-lm's SPM detokenizer detects
    return tokenizer


def _adds(meta: dict, key: str) -> bool:
    """Whether encoding adds the ``key`` ("bos"/"eos") token; llama.cpp's default adds BOS for
    SentencePiece vocabularies only."""
    default = key == "bos" and meta.get("tokenizer.ggml.model") == "llama"
    has_token = f"tokenizer.ggml.{key}_token_id" in meta
    return has_token and bool(meta.get(f"tokenizer.ggml.add_{key}_token", default))


def build_tokenizer(meta: dict):
    """A ``tokenizers.Tokenizer`` equivalent to the GGUF file's llama.cpp tokenizer."""
    try:
        return _build_tokenizer(meta)
    except (CorruptModelError, UnsupportedModelError):
        raise
    except Exception as e:  # tokenizers raises plain Exceptions for vocabularies it rejects
        raise CorruptModelError(f"GGUF tokenizer metadata cannot be built: {e}") from None


def _build_tokenizer(meta: dict):
    from tokenizers import AddedToken, Tokenizer, processors

    if "tokenizer.huggingface.json" in meta:  # the original tokenizer.json, embedded verbatim
        return Tokenizer.from_str(meta["tokenizer.huggingface.json"])
    tokens = _token_list(meta)
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens)
    else:
        raise UnsupportedModelError(f"GGUF tokenizer model {kind!r} is not supported (gpt2, llama)")

    # Matched whole in the raw text, before any splitting, as llama.cpp does.
    added = [
        AddedToken(t, special=token_type != USER_DEFINED, normalized=False)
        for t, token_type in zip(tokens, _token_types(meta), strict=True)
        if token_type in (CONTROL, UNKNOWN, USER_DEFINED)
    ]
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])

    ends = {
        key: meta[f"tokenizer.ggml.{key}_token_id"] for key in ("bos", "eos") if _adds(meta, key)
    }
    if ends:  # the BOS/EOS that llama.cpp puts around every encoded text
        bos = [tokens[ends["bos"]]] if "bos" in ends else []
        eos = [tokens[ends["eos"]]] if "eos" in ends else []
        tokenizer.post_processor = processors.TemplateProcessing(
            single=[*bos, "$A", *eos],
            pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
            special_tokens=sorted({(tokens[i], i) for i in ends.values()}),
        )
    return tokenizer


def eos_token_ids(meta: dict) -> list[int]:
    """Every id that ends generation: the declared eos/eot/eom tokens, then the control tokens
    llama.cpp treats as end-of-generation by name (``<|im_end|>``, ``<end_of_turn>``, ...)."""
    tokens = _token_list(meta)
    types = _token_types(meta)
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ids += [i for i, t in enumerate(tokens) if t in _END_OF_GENERATION and types[i] == CONTROL]
    return list(dict.fromkeys(i for i in ids if i is not None))


def tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json: special token strings, BOS/EOS flags and the chat template."""
    tokens = _token_list(meta)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{name}_token"] = tokens[token_id]
    config["add_bos_token"] = _adds(meta, "bos")
    config["add_eos_token"] = _adds(meta, "eos")
    config["clean_up_tokenization_spaces"] = False
    config["model_max_length"] = meta.get(f"{meta.get('general.architecture')}.context_length")
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


