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

    from mlxspec.eval import SOURCE_KEY

    model, config = load_model(Path(src))
    model, config = quantize_model(model, config, group_size, bits)
    config["quantization"][SOURCE_KEY] = str(src)
    return save_tiny(model, config, dst)
