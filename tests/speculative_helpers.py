"""Shared by the speculative-decoding tests: plain and speculative token runs, drafters
for a given draft model, and the acceptance-against-theory trial counter."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.sampling import SamplingParams
from mlxspec.speculative import (
    DraftModelDrafter,
    first_layers_copy,
    speculative_generate_step,
)

GREEDY = SamplingParams()


def first_layers(model: nn.Module, n: int) -> nn.Module:
    """A deliberately bad draft: the target's first ``n`` layers (shared weights)."""
    return first_layers_copy(model, n)


def drafter_for(model: nn.Module, draft: nn.Module, max_kv_size: int | None = None):
    width = model(mx.array([[0]])).shape[-1]
    return DraftModelDrafter(draft, vocab_size=width, real_vocab=width, max_kv_size=max_kv_size)


def plain_tokens(model, prompt, max_tokens, cache=None, processors=None, sampling=GREEDY):
    cache = cache if cache is not None else make_prompt_cache(model)
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache,
                          sampler=sampling.sampler(), logits_processors=processors)
    return [t for t, _ in steps]


def spec_tokens(model, drafter, prompt, max_tokens, k="auto", cache=None, processors=None,
                sampling=GREEDY, stats=None):
    cache = cache if cache is not None else make_prompt_cache(model)
    steps = speculative_generate_step(
        mx.array(prompt), model, drafter, sampling=sampling, max_tokens=max_tokens,
        prompt_cache=cache, logits_processors=processors, num_draft_tokens=k, stats=stats)
    return [t for t, _, _ in steps]



def record_proposals(drafter) -> list[tuple[int, list[int], np.ndarray | None]]:
    """Make ``drafter`` record (context length, proposed tokens, their q) of every proposal."""
    proposals, propose = [], drafter.propose

    def recording(k, sampling, logits_processor=None, keys=None):
        proposal = propose(k, sampling, logits_processor, keys)
        q = None if proposal.probs is None else np.array(proposal.probs, np.float64)
        proposals.append((len(drafter.context), proposal.tokens, q))
        return proposal

    drafter.propose = recording
    return proposals


def teacher_forced_probs(model, ids: list[int], temp: float = 1.0) -> np.ndarray:
    """(len(ids), vocab) float64 next-token distributions at temperature ``temp``."""
    logits = np.array(model(mx.array([ids]))[0], np.float64) / temp
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def acceptance_against_theory(model, draft_model, prompts, max_tokens, temp=1.0,
                              teacher_forced_draft=True):
    """Generate with k = 1 and compare each trial with the two models' distributions there.

    p is the target's, teacher-forced in float64; q is the draft's, teacher-forced too or (when
    the draft is slow to run over many tokens) the q the drafter reported with its proposal.
    Returns (observed acceptances, sum of beta = sum_x min(p, q), sum of beta (1 - beta), sum of
    sum_x p q, trials) over all verified drafts.
    """
    observed = expected = variance = naive = trials = 0.0
    for prompt in prompts:
        drafter = drafter_for(model, draft_model)
        proposals = record_proposals(drafter)
        out = spec_tokens(model, drafter, prompt, max_tokens, 1,
                          sampling=SamplingParams(temp=temp))
        ids = prompt + out
        p = teacher_forced_probs(model, ids, temp)
        if teacher_forced_draft:
            q = teacher_forced_probs(draft_model, ids, temp)
        for start, tokens, reported in proposals:  # k = 1: each proposal is one trial
            if not tokens or start >= len(ids):
                continue
            q_row = q[start - 1] if teacher_forced_draft else reported[0]
            beta = np.minimum(p[start - 1], q_row).sum()  # p's row predicting `start`
            expected, variance = expected + beta, variance + beta * (1 - beta)
            naive += (p[start - 1] * q_row).sum()
            observed += ids[start] == tokens[0]  # a rejected draft is never the residual
            trials += 1
    return observed, expected, variance, naive, trials


def second_request_while_speculating(engine, first, second, after: int) -> dict:
    """Serve ``first`` alone until it has streamed ``after`` tokens (speculating by then), submit
    ``second``, run both to the end. Returns each request's text and checks the engine's phases:
    batched (not speculative) while both ran, speculating again once ``first`` was alone."""
    a = engine.submit(first)
    texts, phases, b = {a: ""}, [], None
    while engine.streams:
        if len(phases) == after and b is None:
            assert engine.speculating
            b = engine.submit(second)
            texts[b] = ""
        for event in engine.step():
            texts[event.rid] += event.text
            if event.rid == a:
                phases.append((event.speculative, len(engine.streams)))
    shared = [spec for spec, streams in phases if streams == 2]
    assert shared and not any(shared)
    assert phases[-1][0]
    return {"first": texts[a], "second": texts[b]}
