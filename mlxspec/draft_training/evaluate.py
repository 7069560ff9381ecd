"""How good a trained head is on held-out instructions: predicted and measured acceptance.

- predicted: teacher-forced top-1 agreement of each training-time-test step with the target
  (step j: the (j+1)-th drafted token, given the previous drafts were right), on held-out
  answers; with k drafts the expected tokens per pass is 1 + a0 + a0 a1 + ...;
- measured: real speculative decoding (greedy, fixed k) of the held-out instructions, mlxspec's
  own loop: tokens per target pass and the acceptance rate, the numbers a user gets.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxspec.chat_template import chat_prompt
from mlxspec.draft_training.train import _batch
from mlxspec.speculative.eagle3 import Eagle3Head
from mlxspec.speculative.stats import SpecStats


def predicted_acceptance(head: Eagle3Head, samples: list[dict], steps: int) -> list[float]:
    """Per TTT step, the held-out agreement P(head top-1 == target top-1) (answers only)."""
    from mlxspec.draft_training.recipe import ttt_loss

    to_draft = np.full(head.config.vocab_size, -1, np.int32)
    to_draft[np.array(head.draft_ids())] = np.arange(head.config.draft_vocab_size)
    hits, weights = np.zeros(steps), 0.0
    for i in range(len(samples)):
        _, agree = ttt_loss(head, *_batch(samples, [i], to_draft, steps), steps)
        n = max(len(samples[i]["tokens"]) - int(samples[i]["prompt"]), 1)
        hits += np.array(agree.tolist()) * n
        weights += n
    return [round(float(h / max(weights, 1)), 4) for h in hits]


def expected_tokens_per_pass(agreement: list[float]) -> float:
    """1 + a0 + a0 a1 + ... for a chain of len(agreement) drafts."""
    total, run = 1.0, 1.0
    for a in agreement:
        run *= a
        total += run
    return round(total, 3)


def measured_acceptance(
    model: Any, tokenizer: Any, head: Eagle3Head, instructions: list[str], *,
    k: int = 3, max_tokens: int = 128,
) -> dict[str, float]:
    """Greedy speculative decoding of ``instructions`` with ``head`` at a fixed ``k``."""
    from mlxspec.generate import stream_generate
    from mlxspec.speculative.feature import FeatureDrafter

    drafter = FeatureDrafter(head, model, vocab_size=int(model.model.embed_tokens.weight.shape[0]))
    total = SpecStats()
    for text in instructions:
        prompt = chat_prompt(tokenizer, [{"role": "user", "content": text}])
        drafter.reset()
        *_, last = stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                   draft=drafter, num_draft_tokens=k)
        stats = last.spec_stats
        total.drafted += stats.drafted
        total.accepted += stats.accepted
        total.generated += stats.generated
        total.target_passes += stats.target_passes
    mx.clear_cache()
    return {"k": k, "tokens_per_pass": round(total.tokens_per_pass, 3),
            "acceptance_rate": round(total.acceptance_rate, 4), "generated": total.generated}
