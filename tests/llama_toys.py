"""Random llama models small enough to decode thousands of tokens in a test (the one helper)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import llama


def tiny_llama(seed: int = 0, layers: int = 2, vocab: int = 64, scale: float = 4.0, *,
               hidden: int = 64, context: int | None = None) -> llama.Model:
    """A random llama (``hidden`` wide, 4 heads, 2 KV heads) whose output head is scaled by
    ``scale``, so its predictions are far from uniform. ``context``: max_position_embeddings."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=vocab, tie_word_embeddings=False,
        max_position_embeddings=context,
    )
    model = llama.Model(args)
    model.lm_head.weight = scale * model.lm_head.weight
    mx.eval(model.parameters())
    return model
