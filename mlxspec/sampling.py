"""The next-token distribution that mlx-lm's sampler draws from, as probabilities.

mlx-lm's ``make_sampler`` returns tokens, not distributions. Speculative sampling needs the
probabilities of the target and the draft after the *same* transform, so this module rebuilds
that transform from mlx-lm's own filters, applied under the same conditions and in the same order:
top-p, then min-p, then top-k, all on the untempered log-probabilities, then the temperature
(``categorical(logprobs / temp)``). Sampling from ``processed_logprobs`` is therefore sampling from
``make_sampler(temp, top_p, min_p, top_k)``; ``tests/test_sampling.py`` checks it.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlxspec.generate import SamplingParams


def processed_logprobs(logprobs: mx.array, sampling: SamplingParams) -> mx.array:
    """Log-probabilities of the distribution the sampler draws from.

    Args:
        logprobs: (..., vocab) normalized log-probabilities (after logits processors).
        sampling: the sampling parameters; ``temp`` must be > 0 (greedy has no distribution).

    Returns:
        (..., vocab) float32 normalized log-probabilities; ``-inf`` for filtered-out tokens.
    """
    if sampling.temp <= 0:
        raise ValueError("greedy decoding (temp=0) has no sampling distribution")
    # Same filters, same conditions, same order as mlx_lm.sample_utils.make_sampler.
    if 0.0 < sampling.top_p < 1.0:
        logprobs = apply_top_p(logprobs, sampling.top_p)
    if sampling.min_p != 0.0:
        logprobs = apply_min_p(logprobs, sampling.min_p)
    if sampling.top_k > 0:
        logprobs = apply_top_k(logprobs, sampling.top_k)
    # mlx-lm samples categorical(logprobs * (1 / temp)); normalize that to log-probabilities.
    scaled = logprobs.astype(mx.float32) * (1.0 / sampling.temp)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def processed_probs(logprobs: mx.array, sampling: SamplingParams) -> mx.array:
    """(..., vocab) probabilities of the processed distribution (see ``processed_logprobs``)."""
    return mx.exp(processed_logprobs(logprobs, sampling))


def sample(probs: mx.array) -> mx.array:
    """One token per row of ``probs`` (..., vocab), drawn exactly from that distribution.

    Rows need not be normalized; zero entries are never drawn. Returns (...) uint32.
    """
    return mx.random.categorical(mx.log(probs)).astype(mx.uint32)


def normalized_logprobs(logits: mx.array) -> mx.array:
    """``logits - logsumexp(logits)`` over the last axis, exactly as mlx-lm's generate_step."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
