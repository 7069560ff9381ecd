"""The processed next-token distribution is the one mlx-lm's sampler draws from.

Two independent references: an empirical one (10^5 draws of ``make_sampler`` through
``SamplingParams.sampler()``, compared by a chi-square test) and a float64 numpy re-implementation of
the documented transform (top-p, min-p, top-k on the untempered distribution, then temperature).
Chi-square tests use a fixed seed and reject at p < 1e-4; each case also checks that the test has
power (the untransformed distribution is rejected) so a wrong transform cannot pass.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from chi_square import chi_square_pvalue

from mlxspec.sampling import SamplingParams, processed_logprobs, processed_probs, sample

VOCAB = 12
DRAWS = 100_000
ALPHA = 1e-4  # chi-square rejection level (fixed seeds: the outcome is deterministic)

CASES = [
    SamplingParams(temp=1.0),
    SamplingParams(temp=0.6),
    SamplingParams(temp=1.3, top_p=0.8),
    SamplingParams(temp=0.8, top_k=4),
    SamplingParams(temp=1.0, min_p=0.15),
    SamplingParams(temp=0.7, top_p=0.9, min_p=0.05, top_k=6),
]


def random_logprobs(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=1.5, size=VOCAB)
    return logits - np.log(np.exp(logits).sum())


def numpy_reference(logprobs: np.ndarray, s: SamplingParams) -> np.ndarray:
    """float64 re-implementation of the transform mlx-lm documents for its sampler."""
    p = np.exp(logprobs.astype(np.float64))
    keep = np.ones_like(p, dtype=bool)
    if 0 < s.top_p < 1:  # smallest set of most likely tokens whose mass reaches top_p
        order = np.argsort(-p)
        mass_before = np.cumsum(p[order]) - p[order]
        keep[order[mass_before >= s.top_p]] = False
    if s.min_p > 0:  # tokens at least min_p times as likely as the most likely one
        keep &= p >= s.min_p * p.max()
    if s.top_k > 0:  # the k most likely of the survivors
        ranked = np.argsort(-np.where(keep, p, -1.0))
        keep[ranked[s.top_k :]] = False
    out = np.where(keep, p ** (1.0 / s.temp), 0.0)
    return out / out.sum()


def draw_counts(probs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=probs.size)


def assert_same_distribution(counts: np.ndarray, probs: np.ndarray) -> None:
    """Chi-square goodness of fit on the support; no draws outside it."""
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token the distribution excludes"
    expected = probs[support] * counts.sum()
    assert chi_square_pvalue(counts[support], expected) > ALPHA


@pytest.mark.parametrize("case", range(len(CASES)))
def test_processed_distribution_equals_mlx_lm_sampler(case):
    sampling = CASES[case]
    logprobs = random_logprobs(case)
    ours = np.array(processed_probs(mx.array(logprobs, mx.float32), sampling))
    np.testing.assert_allclose(ours.sum(), 1.0, atol=1e-5)
    np.testing.assert_allclose(ours, numpy_reference(logprobs, sampling), atol=1e-5)

    mx.random.seed(case)
    batch = mx.broadcast_to(mx.array(logprobs, mx.float32), (DRAWS, VOCAB))
    tokens = np.array(sampling.sampler()(batch)).astype(np.int64)
    counts = draw_counts(ours, tokens)
    assert_same_distribution(counts, ours)
    # Power: where the transform changes the distribution, the untransformed one is rejected.
    plain = np.exp(logprobs)
    if np.abs(ours - plain).max() > 0.01:
        assert chi_square_pvalue(counts, plain * DRAWS) < ALPHA


def test_chi_square_helper_matches_known_quantiles():
    # Upper 5% / 1% / 0.01% points of the chi-square distribution (tables).
    for statistic, df, p in [(3.841, 1, 0.05), (18.307, 10, 0.05), (6.635, 1, 0.01),
                             (124.342, 100, 0.05), (15.137, 1, 1e-4)]:
        assert abs(gamma_q_of(statistic, df) - p) < 0.02 * p


def gamma_q_of(statistic: float, df: int) -> float:
    from chi_square import gamma_q

    return gamma_q(df / 2, statistic / 2)


def test_sample_draws_from_the_given_distribution():
    probs = np.array([0.5, 0.25, 0.0, 0.125, 0.125])
    mx.random.seed(0)
    tokens = np.array(sample(mx.broadcast_to(mx.array(probs, mx.float32), (DRAWS, 5))))
    assert tokens.dtype == np.uint32
    assert_same_distribution(draw_counts(probs, tokens.astype(np.int64)), probs)


def test_processed_logprobs_are_normalized_and_reject_greedy():
    logprobs = mx.array(random_logprobs(7), mx.float32)
    out = processed_logprobs(logprobs[None], SamplingParams(temp=0.5, top_k=3))
    assert out.shape == (1, VOCAB) and out.dtype == mx.float32
    assert abs(float(mx.logsumexp(out)) - 0.0) < 1e-5
    assert int((out > -float("inf")).sum()) == 3
    with pytest.raises(ValueError):
        processed_logprobs(logprobs, SamplingParams(temp=0.0))
