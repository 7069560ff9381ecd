"""A tiny random llama model directory for tests that need a model but not a real one."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.utils import save_config, save_model

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


def make_tiny_model_dir(path: Path, tokenizer_dir: Path | None = None, seed: int = 0) -> Path:
    """Write a random 2-layer llama (SmolLM2's vocabulary size) to ``path``; copies the
    tokenizer files from ``tokenizer_dir`` when given."""
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(TINY_CONFIG))
    mx.eval(model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(dict(TINY_CONFIG), path / "config.json")
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, path / f.name)
    return path
