"""Speculative sampling end to end: the joint distribution of the first tokens is plain sampling's.

The reference is computed independently in float64 numpy from the target's logits: logit bias,
repetition penalty (mlx-lm's rule: the last 20 tokens' logits divided by the penalty when
positive, multiplied when negative), log-softmax, then top-p, min-p, top-k and the temperature
(``test_sampling.numpy_reference``). The generation runs the whole loop (draft model with k = 2,
processors, rejection sampling, bonus token) many times; a chi-square test compares the counts of
the first three tokens with the exact joint distribution.

This test fails on each of these mutants (checked by applying them): verifying against the
unprocessed target distribution; the draft reporting an untempered q; the target's logits
processors missing the drafted tokens from their history.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from chi_square import chi_square_pvalue
from llama_toys import tiny_llama
from mlx_lm.models import llama
from mlx_lm.sample_utils import make_logits_processors
from test_sampling import numpy_reference

from mlxspec.cache import make_cache
from mlxspec.sampling import SamplingParams
from mlxspec.speculative import DraftModelDrafter, SpecStats, speculative_generate_step

ALPHA = 1e-4
VOCAB = 8
PROMPT = [1, 2, 1, 2]
SAMPLING = SamplingParams(temp=0.6, top_k=5, top_p=0.95, min_p=0.05)
BIAS = {3: 1.0, 5: -0.7}
PENALTY = 2.5


def exact_next(model, ids: list[int], processors: bool = True) -> np.ndarray:
    """(vocab,) float64 distribution plain sampling draws the token after ``ids`` from."""
    logits = np.array(model(mx.array([ids]))[0, -1], np.float64)
    if processors:
        for token, bias in BIAS.items():
            logits[token] += bias
        seen = list(set(ids[-20:]))
        logits[seen] = np.where(logits[seen] < 0, logits[seen] * PENALTY, logits[seen] / PENALTY)
    logprobs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    return numpy_reference(logprobs, SAMPLING)


def exact_joint(model, n: int, processors: bool = True) -> dict[tuple[int, ...], float]:
    """P(x1..xn) of plain sampling, over the sequences with nonzero probability."""
    joint = {(): 1.0}
    for _ in range(n):
        joint = {
            seq + (x,): p * px
            for seq, p in joint.items()
            for x, px in enumerate(exact_next(model, PROMPT + list(seq), processors))
            if px > 0
        }
    return joint


def perturbed_copy(seed: int, noise: float) -> llama.Model:
    """The target with noise on its output head: a draft kept often, but not always."""
    draft = tiny_llama(seed, layers=2, vocab=VOCAB, scale=2.5, hidden=32)
    mx.random.seed(100)
    head = draft.lm_head.weight
    draft.lm_head.weight = head + noise * mx.abs(head).mean() * mx.random.normal(head.shape)
    mx.eval(draft.parameters())
    return draft


def test_first_three_tokens_follow_plain_sampling_with_processors_and_k2():
    target = tiny_llama(2, layers=2, vocab=VOCAB, scale=2.5, hidden=32)
    draft = perturbed_copy(2, noise=0.6)
    exact = exact_joint(target, 3)
    drafter = DraftModelDrafter(draft, vocab_size=VOCAB, real_vocab=VOCAB)
    processors = make_logits_processors(BIAS, PENALTY)
    stats = SpecStats()
    counts: dict[tuple[int, ...], int] = {}
    runs = 1200
    mx.random.seed(0)
    for _ in range(runs):
        steps = speculative_generate_step(
            mx.array(PROMPT), target, drafter, sampling=SAMPLING, max_tokens=3,
            prompt_cache=make_cache(target), logits_processors=processors, num_draft_tokens=2,
            stats=stats,
        )
        seq = tuple(t for t, _, _ in steps)
        counts[seq] = counts.get(seq, 0) + 1
    # Both rejections and full acceptances (with the bonus token) happen; each pass emits
    # accepted + 1 tokens.
    assert stats.accepted_lengths[0] > 0 and stats.accepted_lengths[2] > 0
    assert stats.generated == stats.target_passes + stats.accepted
    assert set(counts) <= set(exact), set(counts) - set(exact)  # nothing outside the support
    cells = sorted(exact, key=exact.get, reverse=True)
    frequent = [c for c in cells if exact[c] * runs >= 5]
    rare = [c for c in cells if exact[c] * runs < 5]
    observed = [counts.get(c, 0) for c in frequent] + [sum(counts.get(c, 0) for c in rare)]
    expected = [exact[c] * runs for c in frequent] + [sum(exact[c] for c in rare) * runs]
    assert chi_square_pvalue(np.array(observed), np.array(expected)) > ALPHA
    # Power: the same counts reject the joint distribution without the logits processors.
    unprocessed = exact_joint(target, 3, processors=False)
    wrong = [unprocessed.get(c, 0.0) * runs for c in frequent]
    wrong.append(runs - sum(wrong))
    assert chi_square_pvalue(np.array(observed), np.maximum(np.array(wrong), 1e-9)) < ALPHA
