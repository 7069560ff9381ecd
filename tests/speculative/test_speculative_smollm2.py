"""Speculative decoding on SmolLM2-135M-Instruct: greedy output equal to plain greedy decoding
(mlx-lm's ``generate_step``) with a 4-bit draft, prompt lookup and a bad draft, a sliding
window, and acceptance rates against sum_x min(p, q) computed in float64 from the two models.

A file of its own (as the Gemma-3 tests) so the test workers share the real-model tests.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache
from speculative_helpers import (
    acceptance_against_theory,
    drafter_for,
    first_layers,
    plain_tokens,
    spec_tokens,
)

from mlxspec.cache import make_cache
from mlxspec.sampling import SamplingParams
from mlxspec.speculative import (
    PromptLookupDrafter,
    SpecStats,
    first_layers_copy,
    make_drafter,
    verify_sampling,
)

SMOL_TOKENS = 64  # tokens per real-model generation: enough for acceptances and rollbacks

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works, step by step.",
    "List ten uses for a paperclip and say why each works.",
]
EDIT = ("Fix the grammar and keep the meaning: 'Octopuses is very clever animal, they can opens "
        "jars and hides in small places when they is scared.'")


def chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


@pytest.fixture(scope="module")
def smol(smollm2):
    """SmolLM2 with its drafts: a 4-bit copy and a bad draft (its first 4 of 30 layers)."""
    model, tokenizer = smollm2
    return model, tokenizer, rounded_4bit_copy(model), first_layers(model, 4)


def rounded_4bit_copy(model: nn.Module) -> nn.Module:
    """``quantized_copy(model)`` with its weights stored dequantized: the same 4-bit affine values
    (mlx-lm's round-to-nearest, group 64) in float32, because MLX's CPU quantized matmul is far
    slower than BLAS. The distributions are the 4-bit model's up to summation order."""
    copy = first_layers_copy(model)
    for _, module in copy.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.shape[-1] % 64 == 0:
            w, scales, biases = mx.quantize(module.weight, group_size=64, bits=4)
            module.weight = mx.dequantize(w, scales, biases, group_size=64, bits=4)
    mx.eval(copy.parameters())
    return copy


@pytest.fixture(scope="module")
def smol_plain(smol):
    """Plain greedy decoding of two prompts (the reference), SMOL_TOKENS tokens."""
    model, tokenizer, _, _ = smol
    return {text: plain_tokens(model, chat_ids(tokenizer, text), SMOL_TOKENS) for text in PROMPTS[:2]}


@pytest.mark.slow
def test_greedy_speculative_equals_plain_greedy_with_a_4bit_draft(smol, smol_plain):
    model, tokenizer, q4, _ = smol
    stats = SpecStats()
    drafter = make_drafter(tokenizer, model, draft_model=q4, draft_tokenizer=tokenizer)
    got = spec_tokens(model, drafter, chat_ids(tokenizer, PROMPTS[0]), SMOL_TOKENS, 2, stats=stats)
    assert got == smol_plain[PROMPTS[0]]
    assert stats.accepted_lengths[-1] > 0 and len(stats.accepted_lengths) == 3  # all kept
    assert stats.accepted_lengths[0] > 0  # and all rejected


@pytest.mark.slow
def test_greedy_speculative_equals_plain_greedy_with_prompt_lookup(smol, smol_plain):
    model, tokenizer, _, _ = smol
    drafter, stats = PromptLookupDrafter(), SpecStats()
    # one drafter for all: it re-indexes when the context changes; the edit copies its input
    # (free text has few matches, and plain steps run between them)
    plain = {**smol_plain, EDIT: plain_tokens(model, chat_ids(tokenizer, EDIT), SMOL_TOKENS)}
    for text in [PROMPTS[0], EDIT]:
        got = spec_tokens(model, drafter, chat_ids(tokenizer, text), SMOL_TOKENS, 4, stats=stats)
        assert got == plain[text], text
    assert stats.drafted > stats.accepted > 0  # acceptances and rollbacks
    assert 0 < stats.plain_passes < stats.target_passes  # plain where lookup found nothing


@pytest.mark.slow
def test_greedy_speculative_equals_plain_greedy_with_a_bad_draft(smol, smol_plain):
    model, tokenizer, _, bad = smol
    stats = SpecStats()
    got = spec_tokens(model, drafter_for(model, bad), chat_ids(tokenizer, PROMPTS[1]), SMOL_TOKENS, 2,
                      stats=stats)
    assert got == smol_plain[PROMPTS[1]]
    assert stats.drafted > stats.accepted  # rejections were rolled back


@pytest.mark.slow
def test_greedy_with_a_small_rotating_cache_equals_plain_past_the_window(smol):
    """max_kv_size = 40 < prompt + generation: the sliding cache rolls back and stays exact."""
    model, tokenizer, _, _ = smol
    prompt = chat_ids(tokenizer, PROMPTS[2])
    expected = plain_tokens(model, prompt, 64, cache=make_cache(model, 40))
    assert expected != plain_tokens(model, prompt, 64)  # the window changes the output
    cache, stats = make_cache(model, 40), SpecStats()
    got = spec_tokens(model, PromptLookupDrafter(), prompt, 64, 4, cache=cache, stats=stats)
    assert got == expected
    assert stats.drafted > stats.accepted > 0
    assert cache[0].offset == len(prompt) + 64 - 1 and type(cache[0]) is RotatingKVCache


@pytest.mark.slow
def test_a_model_drafting_for_itself_at_temperature_1_is_accepted(smol):
    model, tokenizer, _, _ = smol
    stats = SpecStats()
    mx.random.seed(0)
    spec_tokens(model, drafter_for(model, model), chat_ids(tokenizer, PROMPTS[0]), 40, 4,
                sampling=SamplingParams(temp=1.0), stats=stats)
    assert stats.drafted >= 28 and stats.acceptance_rate >= 0.99


@pytest.mark.slow
def test_verify_accepts_a_4bit_draft_within_5_percent_of_sum_min_p_q(smol):
    """The verifier on the two real models' distributions (SmolLM2 and its 4-bit copy, temperature
    1, teacher-forced along the target's own greedy answer): 200 drafts sampled from q at each of
    ~100 positions. Acceptance is within 5% of sum_x min(p, q) (4 standard deviations are ~1%
    here) and far from mlx-lm's sum_x p q. The end-to-end test below checks the same in
    generation, with fewer trials."""
    model, tokenizer, q4, _ = smol
    prompt = chat_ids(tokenizer, PROMPTS[1])
    ids = prompt + plain_tokens(model, prompt, 100)
    positions = slice(len(prompt) - 1, len(ids) - 1)  # the rows predicting the answer's tokens
    p_all = mx.softmax(model(mx.array([ids]))[0, positions].astype(mx.float32), axis=-1)
    q_all = mx.softmax(q4(mx.array([ids]))[0, positions].astype(mx.float32), axis=-1)
    draws = 200
    mx.random.seed(0)
    observed = 0
    for p, q in zip(p_all, q_all, strict=True):
        drafts = mx.random.categorical(mx.log(q), num_samples=draws)[:, None]  # (draws, 1)
        p_rows = mx.broadcast_to(p, (draws, 2, p.shape[-1]))  # k = 1: the draft row and the bonus
        accepted, _ = verify_sampling(p_rows, mx.broadcast_to(q, (draws, 1, q.shape[-1])), drafts)
        observed += int(accepted.sum())
    p64, q64 = np.array(p_all, np.float64), np.array(q_all, np.float64)
    beta = np.minimum(p64, q64).sum(axis=-1)
    expected = draws * beta.sum()
    sigma = np.sqrt(draws * (beta * (1 - beta)).sum())
    assert abs(observed - expected) <= 4 * sigma, (observed, expected, sigma)
    assert abs(observed - expected) <= 0.05 * expected
    assert draws * (p64 * q64).sum() < 0.8 * expected  # what comparing two samples would accept


@pytest.mark.slow
def test_acceptance_with_a_4bit_draft_is_sum_of_min_p_q(smol):
    """SmolLM2 and its 4-bit copy at temperature 1: the observed acceptances match the sum over
    the verified drafts of sum_x min(p, q) within 4 standard deviations (~65 trials, so about 30%;
    the tiny-model test above checks 5% with more trials), far above sum_x p q (about 0.4x)."""
    model, tokenizer, q4, _ = smol
    mx.random.seed(0)
    observed, expected, variance, naive, trials = acceptance_against_theory(
        model, q4, [chat_ids(tokenizer, PROMPTS[0])], 110, teacher_forced_draft=False)
    assert trials >= 45
    assert abs(observed - expected) <= 4 * np.sqrt(variance), (observed, expected, trials)
    assert naive < 0.6 * expected and observed > naive + 4 * np.sqrt(variance)


@pytest.mark.slow
def test_chat_with_a_draft_keeps_both_caches_and_matches_plain_chat(smol):
    from mlxspec.chat import ChatSession

    model, tokenizer, _, bad = smol
    turns = ["Name a planet.", "Why is it called that?"]
    plain = ChatSession(model, tokenizer, max_tokens=16)
    expected = [plain.reply(turn) for turn in turns]
    for options in [dict(draft_model=bad, draft_tokenizer=tokenizer, num_draft_tokens=2),
                    dict(prompt_lookup=True, num_draft_tokens=3)]:
        session = ChatSession(model, tokenizer, max_tokens=16, **options)
        assert [session.reply(turn) for turn in turns] == expected
        assert session.last.spec_stats.drafted > 0
        if options.get("draft_model") is not None:  # the draft cache holds the conversation
            held = session.draft.context[: session.draft.cached]
            assert held == session.cached_tokens[: len(held)] and len(held) > 30


