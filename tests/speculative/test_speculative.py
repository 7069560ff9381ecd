"""Speculative decoding is lossless and rolls back exactly.

References are independent of the code under test: mlx-lm's plain ``generate_step`` (greedy
token-for-token equality), exact next-token distributions computed in float64 numpy from the
target's logits (sampling), mlx-lm's ``RotatingKVCache`` fed one token at a time (the sliding-window
cache), and hand-made distributions (the rejection-sampling step).

Chi-square tests use fixed seeds and reject at p < 1e-4 (``ALPHA``); each also checks its power
against a wrong distribution. The tests on the real models are in ``test_speculative_smollm2.py``
and ``test_speculative_gemma3.py`` (files of their own, so the two test workers share them).
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest
from chi_square import chi_square_pvalue
from llama_toys import tiny_llama
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from speculative_helpers import (
    GREEDY,
    acceptance_against_theory,
    drafter_for,
    first_layers,
    plain_tokens,
    spec_tokens,
)

from mlxspec.cache import make_cache
from mlxspec.errors import TokenizerMismatchError
from mlxspec.generate import SpeculativeFallbackWarning, token_generator
from mlxspec.sampling import SamplingParams
from mlxspec.speculative import (
    DraftModelDrafter,
    PromptLookupDrafter,
    SpecStats,
    check_same_tokenizer,
    quantized_copy,
    speculative_generate_step,
    verify_greedy,
    verify_sampling,
)

ALPHA = 1e-4


# -- the verification step on hand-made distributions -----------------------------------------


def test_verify_greedy_accepts_the_agreeing_prefix_then_the_targets_token():
    target_argmax = [[3, 1, 4, 1], [3, 1, 4, 1], [3, 1, 4, 1]]
    drafts = mx.array([[3, 1, 4], [3, 2, 4], [0, 1, 4]])
    logprobs = mx.log(mx.array(np.eye(5)[np.array(target_argmax)] * 0.9 + 0.02, mx.float32))
    accepted, token = verify_greedy(logprobs, drafts)
    assert accepted.tolist() == [3, 1, 0]
    assert token.tolist() == [1, 1, 3]  # the bonus token, then the target's at the mismatch


P = np.array([[0.40, 0.30, 0.15, 0.10, 0.05, 0.00],
              [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],
              [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])
Q = np.array([[0.10, 0.50, 0.10, 0.10, 0.10, 0.10],
              [0.30, 0.10, 0.30, 0.10, 0.10, 0.10]])


def test_verify_sampling_emits_the_target_distribution():
    """Drafts drawn from q, verified against p: the emitted tokens follow p, position by position."""
    batch = 200_000
    mx.random.seed(0)
    q = mx.broadcast_to(mx.array(Q, mx.float32), (batch, 2, 6))
    p = mx.broadcast_to(mx.array(P, mx.float32), (batch, 3, 6))
    drafts = mx.random.categorical(mx.log(q)).astype(mx.uint32)  # (batch, 2)
    accepted, token = verify_sampling(p, q, drafts)
    accepted, token, drafts = np.array(accepted), np.array(token), np.array(drafts)
    # The emitted sequence is d1..d_n, then `token`.
    emitted = np.concatenate([drafts, np.zeros((batch, 1), np.uint32)], axis=1)
    emitted[np.arange(batch), accepted] = token
    for position, rows in [(0, np.ones(batch, bool)), (1, accepted >= 1), (2, accepted == 2)]:
        counts = np.bincount(emitted[rows, position], minlength=6)
        support = P[position] > 0
        assert counts[~support].sum() == 0
        assert chi_square_pvalue(counts[support], P[position][support] * rows.sum()) > ALPHA
    # The first draft is kept with probability sum(min(p, q)) (binomial, 5 standard deviations).
    beta = np.minimum(P[0], Q[0]).sum()
    assert abs((accepted >= 1).mean() - beta) < 5 * np.sqrt(beta * (1 - beta) / batch)
    # Power: the drafts themselves (distribution q) fail the same test.
    counts = np.bincount(drafts[:, 0], minlength=6)
    assert chi_square_pvalue(counts[P[0] > 0], P[0][P[0] > 0] * batch) < ALPHA


def test_verify_sampling_with_deterministic_proposals():
    """Prompt lookup proposes with q one-hot: d is kept with probability p(d)."""
    batch = 200_000
    mx.random.seed(1)
    p = mx.broadcast_to(mx.array(P[:2], mx.float32), (batch, 2, 6))
    drafts = mx.full((batch, 1), 1, mx.uint32)
    accepted, token = verify_sampling(p, None, drafts)
    accepted, token = np.array(accepted), np.array(token)
    first = np.where(accepted == 1, 1, token)
    assert chi_square_pvalue(np.bincount(first, minlength=6)[:5], P[0][:5] * batch) > ALPHA
    assert abs(accepted.mean() - P[0][1]) < 5 * np.sqrt(0.3 * 0.7 / batch)


def test_verify_sampling_without_drafts_samples_the_target():
    """k = 0 (speculation paused): one plain sample from p_0."""
    batch = 100_000
    mx.random.seed(2)
    p = mx.broadcast_to(mx.array(P[1:2], mx.float32), (batch, 1, 6))
    accepted, token = verify_sampling(p, None, mx.zeros((batch, 0), mx.uint32))
    assert int(mx.max(accepted)) == 0
    counts = np.bincount(np.array(token), minlength=6)
    assert chi_square_pvalue(counts, P[1] * batch) > ALPHA


# -- greedy equality on tiny models ---------------------------------------------------------------

PROMPT = [1, 5, 7, 9, 3, 5, 7, 2, 8, 8, 1, 5, 7, 11, 12, 5, 7]


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_llama(0, layers=4)


@pytest.mark.parametrize("k", [1, 4, "auto"])
@pytest.mark.parametrize("kind", ["self", "other", "bad", "lookup"])
def test_greedy_speculative_equals_plain_greedy_on_tiny_models(tiny_target, kind, k):
    model = tiny_target
    drafter = {
        "self": lambda: drafter_for(model, model),
        "other": lambda: drafter_for(model, tiny_llama(1)),
        "bad": lambda: drafter_for(model, first_layers(model, 1)),
        "lookup": lambda: PromptLookupDrafter(),
    }[kind]()
    stats = SpecStats()
    assert spec_tokens(model, drafter, PROMPT, 80, k, stats=stats) == plain_tokens(model, PROMPT, 80)
    assert stats.generated == 80
    assert stats.generated == stats.target_passes + stats.accepted  # each pass: accepted + 1
    if k != "auto":
        assert stats.drafted > 0


@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_with_a_rotating_cache_past_its_window_equals_plain(tiny_target, k):
    model = tiny_target
    expected = plain_tokens(model, PROMPT, 120, cache=make_cache(model, 24))
    assert expected != plain_tokens(model, PROMPT, 120)  # the window matters
    cache = make_cache(model, 24)
    got = spec_tokens(model, drafter_for(model, first_layers(model, 2), max_kv_size=24), PROMPT,
                      120, k, cache=cache)
    assert got == expected
    assert all(type(c) is RotatingKVCache for c in cache)  # the caller's cache types are restored


def test_logits_processors_see_the_same_history_as_plain_decoding(tiny_target):
    model = tiny_target
    processors = make_logits_processors({3: 1.5, 7: -2.0}, repetition_penalty=1.5,
                                        repetition_context_size=40)
    expected = plain_tokens(model, PROMPT, 60, processors=processors)
    assert expected != plain_tokens(model, PROMPT, 60)
    for drafter in (drafter_for(model, tiny_llama(1)), PromptLookupDrafter()):
        assert spec_tokens(model, drafter, PROMPT, 60, 3, processors=processors) == expected


def test_closing_early_leaves_only_yielded_tokens_in_the_cache(tiny_target):
    model = tiny_target
    cache = make_prompt_cache(model)
    steps = speculative_generate_step(mx.array(PROMPT), model, drafter_for(model, model),
                                      sampling=GREEDY, max_tokens=50, prompt_cache=cache,
                                      num_draft_tokens=6)
    got = [next(steps)[0] for _ in range(3)]  # the first pass accepts 6 drafts; stop after 3
    steps.close()
    assert got == plain_tokens(model, PROMPT, 3)
    assert len(PROMPT) + 2 <= cache[0].offset <= len(PROMPT) + 3


class SlowDrafter(DraftModelDrafter):
    """A perfect draft (the target itself) that takes 50 ms per drafted token: never worth it."""

    def __init__(self, model):
        width = model(mx.array([[0]])).shape[-1]
        super().__init__(model, vocab_size=width, real_vocab=width)
        self.step_seconds = 0.05

    def propose(self, k, sampling, logits_processor=None, keys=None):
        time.sleep(0.05 * k)
        return super().propose(k, sampling, logits_processor, keys)


def test_paused_speculation_decodes_plainly_and_exactly(tiny_target):
    """When drafting does not pay, auto-k pauses and decodes plainly (pipelined), retrying on a
    backed-off schedule; stopping in the middle leaves only yielded tokens in the cache."""
    model = tiny_target
    stats = SpecStats()
    assert spec_tokens(model, SlowDrafter(model), PROMPT, 60, stats=stats) == \
        plain_tokens(model, PROMPT, 60)
    speculative_passes = stats.target_passes - stats.plain_passes
    assert 1 <= speculative_passes <= 6 and stats.plain_passes >= 45
    # each pause (16, then 32 tokens) runs as one stretch of plain steps: one decision (a
    # sharded target's message) for all of its tokens, not one a token
    stretches = stats.decisions - speculative_passes
    assert 1 <= stretches <= stats.plain_passes / 8
    cache = make_prompt_cache(model)
    steps = speculative_generate_step(mx.array(PROMPT), model, SlowDrafter(model),
                                      sampling=GREEDY, max_tokens=60, prompt_cache=cache)
    got = [next(steps)[0] for _ in range(30)]
    steps.close()
    assert got == plain_tokens(model, PROMPT, 30)
    assert len(PROMPT) + 28 <= cache[0].offset <= len(PROMPT) + 30


def test_a_cache_that_cannot_roll_back_falls_back_to_plain_decoding(tiny_target):
    class FixedCache(KVCache):
        def is_trimmable(self):
            return False

    model = tiny_target
    cache = [FixedCache() for _ in model.layers]
    stats = SpecStats()
    with pytest.warns(SpeculativeFallbackWarning, match="cannot roll back"):
        steps = token_generator(mx.array(PROMPT), model, sampling=GREEDY, max_tokens=20,
                                prompt_cache=cache, draft=drafter_for(model, model),
                                num_draft_tokens=3, spec_stats=stats)
        got = [t for t, _, _ in steps]
    assert got == plain_tokens(model, PROMPT, 20)
    assert stats.fallback and stats.drafted == 0 and "off" in stats.summary()


# -- sampling end to end (the joint distribution: tests/speculative/test_speculative_sampling.py) -----------


def test_acceptance_of_a_4bit_copy_is_sum_of_min_p_q_on_a_tiny_model():
    """Each verified draft is kept with probability sum_x min(p(x), q(x)) (rejection sampling),
    not the sum_x p(x) q(x) of comparing two independent samples: within 5% over ~1250 trials
    (one standard deviation is ~1% here)."""
    target = tiny_llama(4, layers=2, vocab=64, scale=3.0)
    q4 = quantized_copy(target)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, 12).tolist() for _ in range(8)]
    mx.random.seed(0)
    observed, expected, variance, naive, trials = acceptance_against_theory(target, q4, prompts,
                                                                            300)
    assert trials >= 1000
    assert abs(observed - expected) <= 0.05 * expected, (observed, expected, trials)
    assert abs(observed - expected) <= 4 * np.sqrt(variance)
    assert naive < 0.9 * expected  # the sample-comparison rule would accept visibly less


# -- drafters, tokenizer check, planner ------------------------------------------------------------


def test_prompt_lookup_continues_the_latest_occurrence_of_the_longest_ngram():
    lookup = PromptLookupDrafter(ngram_max=3)
    context = [9, 1, 2, 3, 4, 5, 7, 1, 2, 3, 6, 8, 0, 2, 3]
    lookup.begin(context)
    assert lookup.propose(3, GREEDY).tokens == [6, 8, 0]  # "2 3" -> latest match
    lookup.extend([6])
    assert lookup.propose(2, GREEDY).tokens == [8, 0]  # "2 3 6" wins
    lookup.begin([5, 4, 3])
    assert lookup.propose(4, GREEDY).tokens == []  # re-indexed, no match
    lookup.extend([5])
    assert lookup.propose(4, GREEDY).tokens == [4, 3, 5, 4]  # continues periodically


def test_prompt_lookup_indexes_the_prompt_once_and_each_token_in_constant_work():
    """The prompt is indexed in ``begin`` (a one-off, timed apart from drafting); a draft step
    after one new token indexes only that token's n-grams, whatever the context's length."""

    class CountingDict(dict):
        writes = 0

        def __setitem__(self, key, value):
            CountingDict.writes += 1
            super().__setitem__(key, value)

    rng = np.random.default_rng(0)
    for length in (1_000, 50_000):
        lookup = PromptLookupDrafter(ngram_max=3)
        lookup.begin(rng.integers(0, 500, length).tolist())
        assert lookup.indexed == length - 1
        lookup.latest = CountingDict(lookup.latest)
        lookup.context = CountingList(lookup.context)
        CountingDict.writes = CountingList.touched = 0
        for t in rng.integers(0, 500, 20).tolist():
            lookup.extend([t])
            lookup.propose(4, GREEDY)
        assert CountingDict.writes <= 20 * 3 * 2
        assert CountingList.touched <= 20 * 50  # context elements read: not O(length)


class CountingList(list):
    """A list that counts the elements read through slices and iteration."""

    touched = 0

    def __getitem__(self, index):
        item = super().__getitem__(index)
        CountingList.touched += len(item) if isinstance(index, slice) else 1
        return item

    def __iter__(self):
        CountingList.touched += len(self)
        return super().__iter__()


def test_prompt_lookup_continues_a_periodic_match_to_k_tokens():
    lookup = PromptLookupDrafter(ngram_max=3)
    lookup.begin([1, 2, 3] * 10)
    assert lookup.propose(8, GREEDY).tokens == [1, 2, 3, 1, 2, 3, 1, 2]
    lookup.begin([7, 7])
    assert lookup.propose(4, GREEDY).tokens == [7, 7, 7, 7]


class FakeTokenizer:
    def __init__(self, tokens, bos=0, eos=1, pad=None, special=("<s>", "</s>")):
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos, eos, pad
        self.all_special_tokens = list(special)

    def get_vocab(self):
        return dict(self.vocab)


def test_check_same_tokenizer_allows_padding_and_names_the_first_difference():
    base = ["<s>", "</s>", "a", "b", "c"]
    check_same_tokenizer(FakeTokenizer(base), FakeTokenizer(base + ["<extra_0>", "<extra_1>"]))
    with pytest.raises(TokenizerMismatchError, match=r"token id 3 is 'b' .* but 'x'"):
        check_same_tokenizer(FakeTokenizer(base), FakeTokenizer(["<s>", "</s>", "a", "x", "c"]))
    with pytest.raises(TokenizerMismatchError, match="EOS"):
        check_same_tokenizer(FakeTokenizer(base), FakeTokenizer(base, eos=4))
    with pytest.raises(TokenizerMismatchError, match="the reference model.*PAD"):
        check_same_tokenizer(FakeTokenizer(base), FakeTokenizer(base, pad=2), "the reference model")


def test_a_draft_confidence_threshold_stops_drafts_early_and_stays_exact(tiny_target):
    model = tiny_target
    width = model(mx.array([[0]])).shape[-1]
    drafter = DraftModelDrafter(tiny_llama(1), vocab_size=width, real_vocab=width,
                                min_confidence=0.6)
    stats = SpecStats()
    assert spec_tokens(model, drafter, PROMPT, 60, 6, stats=stats) == plain_tokens(model, PROMPT, 60)
    speculative = stats.target_passes - stats.plain_passes
    assert 0 < stats.drafted < 6 * speculative  # some drafts stopped before k


def test_draft_ids_beyond_the_real_vocabulary_are_never_proposed(tiny_target):
    """A draft whose embedding is padded (vocab 64) for a target with 40 real tokens."""
    model = tiny_target
    drafter = DraftModelDrafter(tiny_llama(1), vocab_size=64, real_vocab=40)
    drafter.begin(PROMPT)
    proposal = drafter.propose(8, SamplingParams(temp=1.0))
    assert proposal.probs.shape == (8, 64)
    assert float(proposal.probs[:, 40:].sum()) == 0.0 and max(proposal.tokens) < 40
    assert spec_tokens(model, drafter, PROMPT, 30, 3) == plain_tokens(model, PROMPT, 30)
