"""`mlxspec.serving.fused_prefill`: the running rows' decode step and joining prompts in one forward give
bitwise the logits and caches of the two forwards run apart (SmolLM2)."""

from __future__ import annotations

import platform

import mlx.core as mx
import pytest

from mlxspec.cache import make_cache
from mlxspec.generate import generate
from mlxspec.serving import decode_batch as engine_batch
from mlxspec.serving import rows as engine_rows
from mlxspec.serving.decode_batch import last_token_logits
from mlxspec.serving.engine import Engine, Request
from mlxspec.serving.fused_prefill import Part, WithPrefill, fused_logits, supported
from tests.serving.test_decode_batch import wrong_and_flagged

# The two forwards agree bit for bit because the Linux BLAS shim's products do not depend on the
# number of rows; Metal's matmuls (and Accelerate's) give no such promise.
pytestmark = pytest.mark.skipif(platform.system() != "Linux",
                                reason="bitwise equality needs the Linux CPU backend's BLAS shim")

ROWS = 8


def _running_rows(model) -> list:
    """Batch caches of ROWS rows at different lengths (left-padded, as in a running batch)."""
    caches = [make_cache(model) for _ in range(ROWS)]
    for i, cache in enumerate(caches):
        model(mx.array([[11 + i] * (9 + 5 * i)]), cache=cache)
        mx.eval([c.state for c in cache])
    return [layer.merge([c[i] for c in caches]) for i, layer in enumerate(caches[0])]


def _joining(model, prompts: list[list[int]]):
    """A group of prompts on caches that already hold a shared start, right-padded as
    ``DecodeBatch`` pads a group: tokens, caches, lengths."""
    rows = []
    for _ in prompts:
        cache = make_cache(model)
        model(mx.array([[7] * 12]), cache=cache)
        mx.eval([c.state for c in cache])
        rows.append(cache)
    lengths = [len(p) for p in prompts]
    padding = [max(lengths) - n for n in lengths]
    cache = [layer.merge([c[i] for c in rows]) for i, layer in enumerate(rows[0])]
    if any(padding):
        for c in cache:
            c.prepare(lengths=lengths, right_padding=padding)
    tokens = mx.array([p + [0] * pad for p, pad in zip(prompts, padding, strict=True)])
    return tokens, cache, lengths


def _states(caches) -> list[mx.array]:
    return [a for c in caches for a in c.state if isinstance(a, mx.array)]


@pytest.mark.parametrize("lengths", [[13], [5, 8]], ids=["one-prompt", "two-padded"])
def test_fused_forward_is_bitwise_the_two_forwards(smollm2, lengths):
    model, tokenizer = smollm2
    text = tokenizer.encode("Write a haiku about the sea, then explain why it rhymes.")
    prompts = [text[: n] for n in lengths]
    inputs = mx.array([[100 + i] for i in range(ROWS)])

    apart_rows, (tokens, apart_group, n) = _running_rows(model), _joining(model, prompts)
    decode = model(inputs, cache=apart_rows)[:, -1]
    prefill = last_token_logits(model, tokens, apart_group, n)
    mx.eval(decode, prefill)

    fused_rows, (tokens, fused_group, n) = _running_rows(model), _joining(model, prompts)
    fused_decode, fused_prefill = fused_logits(
        model, [Part(inputs, fused_rows), Part(tokens, fused_group, [k - 1 for k in n])])
    mx.eval(fused_decode, fused_prefill)

    assert fused_decode.shape == (ROWS, decode.shape[-1])
    assert fused_prefill.shape == (len(prompts), decode.shape[-1])
    assert mx.array_equal(fused_decode, decode).item()
    assert mx.array_equal(fused_prefill, prefill).item()
    for apart, fused in ((apart_rows, fused_rows), (apart_group, fused_group)):
        assert all(mx.array_equal(a, b).item()
                   for a, b in zip(_states(apart), _states(fused), strict=True))


def test_with_prefill_runs_the_queued_prompt_once(smollm2):
    model, tokenizer = smollm2
    wrapped = WithPrefill(model)
    assert wrapped.supported
    rows = _running_rows(model)
    tokens, group, n = _joining(model, [tokenizer.encode("The capital of France is")])
    wrapped.queue(Part(tokens, group, [k - 1 for k in n]))
    inputs = mx.array([[3]] * ROWS)
    first = wrapped(inputs, cache=rows)
    assert first.shape[:2] == (ROWS, 1)
    expected = last_token_logits(model, *_joining(model, [tokenizer.encode(
        "The capital of France is")]))  # the same prompt on its own
    assert mx.array_equal(wrapped.take(), expected).item()
    with pytest.raises(RuntimeError, match="did not run"):
        wrapped.take()
    # Nothing queued: the model's own forward.
    plain = wrapped(inputs, cache=_running_rows(model))
    assert mx.array_equal(plain, model(inputs, cache=_running_rows(model))).item()


def test_only_llama_family_models_are_fused(smollm2, gemma3):
    assert supported(smollm2[0])
    assert not supported(gemma3[0])  # sliding-window layers, extra norms: its own forward


@pytest.mark.parametrize("mix", ["all-flagged", "with-a-sampled-row"])
def test_prompts_joining_through_the_fused_step_keep_plain_greedy_text(smollm2, monkeypatch, mix):
    """Prompts join a running batch through the fused step while its forward is redone (every
    greedy token flagged as a near-tie: the caches step back and the step runs again, without
    the prompts) or while a sampled row makes the batch take mlx-lm's own step: every greedy
    request's text is plain greedy decoding's."""
    model, tokenizer = smollm2
    fused = []
    queue = engine_batch.DecodeBatch._queue_fused_prefill
    monkeypatch.setattr(engine_batch.DecodeBatch, "_queue_fused_prefill", lambda self: (
        lambda out: (fused.append(out is not None), out)[1])(queue(self)))
    if mix == "all-flagged":
        monkeypatch.setattr(engine_rows, "greedy_candidates", wrong_and_flagged)
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
    engine = Engine(model, tokenizer, max_batch=8, prompt_cache_size=0)
    greedy = {engine.submit(Request(tokenizer.encode(prompts[0]), max_tokens=10)): (prompts[0], 10)}
    if mix == "with-a-sampled-row":
        engine.submit(Request(tokenizer.encode("Once upon a time"), max_tokens=12, temp=0.8))
    texts: dict[int, str] = {}

    def step() -> None:
        for event in engine.step():
            texts[event.rid] = texts.get(event.rid, "") + event.text

    step()
    step()
    greedy.update({engine.submit(Request(tokenizer.encode(p), max_tokens=6)): (p, 6)
                   for p in prompts[1:]})
    while engine.streams:
        step()
    assert any(fused)  # the joining prompts went through the fused step
    assert {rid: texts[rid] for rid in greedy} == {
        rid: generate(model, tokenizer, p, max_tokens=n) for rid, (p, n) in greedy.items()}
