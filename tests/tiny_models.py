"""Tiny random mlx-lm llama models with a byte-level tokenizer, saved as real model directories.

They load through ``mlxspec.load`` / ``mlx_lm.utils.load_model`` like any Hub model, in well under a
second, so evaluation and Hub tests need neither the default model nor the network.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.utils import save_config, save_model

VOCAB = 260  # 256 byte tokens + 4 specials (ids 256..259)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_config(**overrides) -> dict:
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "eos_token_id": 256,
        "bos_token_id": 256,
    }
    config.update(overrides)
    return config


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer without merges (one token per byte) and ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet)  # 256 printable stand-ins for the bytes
    vocab = {c: i for i, c in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "pad_token": "<pad>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 1 << 20,
            },
            indent=2,
        )
    )


def save_tiny(model, config: dict, path: Path, tokenizer_dir: Path | None = None) -> Path:
    """Write ``model`` and ``config`` to ``path`` with the byte tokenizer, or with the tokenizer
    files of ``tokenizer_dir``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model, donate_model=False)
    save_config(config, path / "config.json")
    if tokenizer_dir is None:
        save_byte_tokenizer(path)
        return path
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


def make_tiny_model(
    path: Path, seed: int = 0, tokenizer_dir: Path | None = None, **config_overrides
) -> Path:
    """Write a random tiny llama model (float32) to ``path`` with the byte tokenizer, or with the
    tokenizer files of ``tokenizer_dir`` (then pass its ``vocab_size``)."""
    config = tiny_config(**config_overrides)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Larger-than-default embeddings so the tiny model's predictions are not near-uniform.
    model.model.embed_tokens.weight = 0.25 * mx.random.normal(model.model.embed_tokens.weight.shape)
    mx.eval(model.parameters())
    return save_tiny(model, config, path, tokenizer_dir)


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int = 1) -> Path:
    """Copy of the model in ``src`` with Gaussian noise of relative size ``noise`` on every
    matrix: a stand-in for a quantized model whose distance from its source is known."""
    from mlx_lm.utils import load_model

    model, config = load_model(Path(src))
    mx.random.seed(seed)
    noisy = [
        (k, v + noise * v.std() * mx.random.normal(v.shape) if v.ndim == 2 else v)
        for k, v in tree_flatten(model.parameters())
    ]
    model.load_weights(noisy)
    mx.eval(model.parameters())
    return save_tiny(model, config, dst)


def quantized_copy(src: Path, dst: Path, bits: int, group_size: int = 32) -> Path:
    """mlx-lm affine round-to-nearest quantization of the model in ``src``, saved to ``dst`` with
    its source recorded in ``config["quantization"]["source_model"]`` as mlxspec's quantizer does."""
    from mlx_lm.utils import load_model, quantize_model

    from mlxspec.evaluation import SOURCE_KEY

    model, config = load_model(Path(src))
    model, config = quantize_model(model, config, group_size, bits)
    config["quantization"][SOURCE_KEY] = str(src)
    return save_tiny(model, config, dst)


# -- tiny GGUF files -----------------------------------------------------------------------------

GGUF_VOCAB = 258  # 256 byte tokens, "he", "<|endoftext|>"


def gpt2_byte_spelling() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (byte-level BPE token strings)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_tiny_gguf(
    path: Path,
    meta: dict | None = None,
    drop: tuple[str, ...] = (),
    shapes: dict[str, tuple[int, ...]] | None = None,
    n_tokens: int = GGUF_VOCAB,
    types: dict | None = None,
    arch: str = "llama",
    untied_output: bool = False,
) -> Path:
    """A 2-layer llama GGUF (hidden 64, 4 heads / 2 KV heads, byte-level vocabulary of 258 with
    the merge "h e"), written with the ``gguf`` package in a few milliseconds.

    Args:
        meta: metadata to set or replace, ``{key: (value, GGUFValueType[, item type])}``.
        drop: metadata keys or tensor names to leave out.
        shapes: tensor shapes (numpy order) to use instead of the consistent ones.
        n_tokens: vocabulary size (the embedding keeps 258 rows).
        types: tensor type by full name or by role (``"attn_q"``, ``"token_embd"``, ...);
            float32 otherwise. Types the ``gguf`` package cannot write get random blocks.
        arch: ``general.architecture`` (its metadata keys are spelled for it).
        untied_output: add an ``output.weight`` matrix (else the embedding is tied).
    """
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
    from gguf.gguf_writer import GGUFValue
    from gguf.quants import quantize

    rng = np.random.default_rng(1)
    hidden, ffn, heads, kv_heads, layers = 64, 128, 4, 2, 2
    tokens = gpt2_byte_spelling() + ["he", "<|endoftext|>"]
    tokens += [f"<extra_{i}>" for i in range(n_tokens - len(tokens))]
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3] + [1] * (n_tokens - GGUF_VOCAB))
    writer.add_token_merges(["h e"])
    writer.add_eos_token_id(257)
    for key, spec in (meta or {}).items():
        writer.kv_data[0][key] = GGUFValue(spec[0], spec[1], spec[2] if len(spec) > 2 else None)
    for key in drop:
        writer.kv_data[0].pop(key, None)

    def add(name: str, shape: tuple[int, ...]):
        if name in drop:
            return
        shape = (shapes or {}).get(name, shape)
        role = name.split(".")[-2]
        qtype = (types or {}).get(name, (types or {}).get(role, GGMLQuantizationType.F32))
        w = rng.standard_normal(shape).astype(np.float32) * (1.0 if role.endswith("norm") else 0.2)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            writer.add_tensor(name, quantize(w, qtype))
            return
        try:
            data = quantize(w, qtype).view(np.uint8)
        except NotImplementedError:  # a type gguf cannot write: random blocks will do
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            data = rng.integers(0, 256, (shape[0], shape[1] // block * block_bytes), np.uint8)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    add("token_embd.weight", (GGUF_VOCAB, hidden))
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,))
        add(f"blk.{i}.attn_q.weight", (hidden, hidden))
        add(f"blk.{i}.attn_k.weight", (hidden // heads * kv_heads, hidden))
        add(f"blk.{i}.attn_v.weight", (hidden // heads * kv_heads, hidden))
        add(f"blk.{i}.attn_output.weight", (hidden, hidden))
        add(f"blk.{i}.ffn_norm.weight", (hidden,))
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    add("output_norm.weight", (hidden,))
    if untied_output:
        add("output.weight", (GGUF_VOCAB, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def patch_tensor_info(
    path: Path, name: str, dims: list[int] | None = None, type_id: int | None = None,
    offset: int | None = None,
) -> Path:
    """Rewrite fields of tensor ``name``'s entry in a GGUF header in place: its dimensions (ggml
    order, fastest first; as many as before), its type id or its data offset."""
    import struct

    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, at)
    if dims is not None:
        assert n_dims == len(dims), (n_dims, dims)
        struct.pack_into(f"<{n_dims}Q", data, at + 4, *dims)
    if type_id is not None:
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    if offset is not None:
        struct.pack_into("<Q", data, at + 8 + 8 * n_dims, offset)
    path.write_bytes(bytes(data))
    return path


def patch_gguf_header(path: Path, **fields: int) -> Path:
    """Rewrite header fields in place: ``version``, ``n_tensors``, ``n_kv``, or ``first_type``
    (the value type of the first metadata entry) / ``first_key_length``."""
    import struct

    data = bytearray(path.read_bytes())
    (key_length,) = struct.unpack_from("<Q", data, 24)
    where = {"version": (4, "<I"), "n_tensors": (8, "<Q"), "n_kv": (16, "<Q"),
             "first_key_length": (24, "<Q"), "first_type": (32 + key_length, "<I")}
    for field, value in fields.items():
        at, fmt = where[field]
        struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))
    return path


def write_nested_array_gguf(path: Path, depth: int) -> Path:
    """A GGUF header whose only metadata value is an array of arrays ``depth`` levels deep."""
    import struct

    array, uint32 = 9, 4  # GGUFValueType.ARRAY, UINT32
    key = b"general.nested"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<I", array)
    body += struct.pack("<IQ", array, 1) * (depth - 1) + struct.pack("<IQ", uint32, 1)
    body += struct.pack("<I", 7)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body)
    return path
