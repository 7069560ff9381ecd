"""The self-generated calibration domain: the float model's own answers to the built-in prompts
(:mod:`mlxspec.quant.calibration_set` cuts them into windows). It generates with continuous
batching, so it lives above the quantizers, beside the flow that calls it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxspec.chat_template import chat_prompt
from mlxspec.progress import progress_bar
from mlxspec.quant.calibration_set import ANSWER_TOKENS, SAMPLING, SEED
from mlxspec.serving.batch import batch_generate


def generate_conversations(
    model: nn.Module,
    tokenizer,
    questions: list[str],
    *,
    max_tokens: int = ANSWER_TOKENS,
    progress: bool = False,
) -> list[list[dict[str, str]]]:
    """The model's own answers to ``questions``: ``[[{"role": "user", ...}, {"role":
    "assistant", ...}], ...]``, sampled (:data:`~mlxspec.quant.calibration_set.SAMPLING`, seeded) with continuous batching."""
    prompt_ids = [chat_prompt(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    mx.random.seed(SEED)
    with progress_bar("self-generated calibration", None, progress):
        results = batch_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens,
                                 batch_size=min(16, len(prompt_ids)), **SAMPLING)
    return [[{"role": "user", "content": q}, {"role": "assistant", "content": r.text.strip()}]
            for q, r in zip(questions, results, strict=True) if r.text.strip()]
