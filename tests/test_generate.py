"""The generation API: greedy decoding against an independent loop, stop strings, seeds, EOS."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxspec.generate import _StopMatcher, generate, stream_generate


def reference_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding with no KV cache: the whole sequence is re-run for every token."""
    ids = list(prompt_ids)
    for _ in range(n):
        logits = model(mx.array([ids]))[0, -1]
        ids.append(int(mx.argmax(logits)))
    return ids[len(prompt_ids) :]


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
    )


def test_greedy_stream_equals_uncached_greedy_loop(smollm2):
    model, tokenizer = smollm2
    prompt = chat_ids(tokenizer, "Name three primary colors.")
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=12))
    tokens = [r.token for r in responses]
    expected = reference_greedy(model, prompt, len(tokens))
    assert tokens == expected
    assert len(tokens) == 12 or responses[-1].finish_reason == "stop"


def test_capital_of_france_is_paris(smollm2):
    model, tokenizer = smollm2
    text = generate(
        model, tokenizer, chat_ids(tokenizer, "What is the capital of France?"), max_tokens=24
    )
    assert "Paris" in text


def test_stats_and_finish_reason(smollm2):
    model, tokenizer = smollm2
    responses = list(stream_generate(model, tokenizer, "Once upon a time", max_tokens=5))
    last = responses[-1]
    assert last.finish_reason == "length"
    assert last.generation_tokens == 5 and len(responses) == 5
    assert last.prompt_tokens == len(tokenizer.encode("Once upon a time"))
    assert last.prompt_tps > 0 and last.generation_tps > 0 and last.peak_memory > 0


def test_eos_stops_generation_and_is_not_in_the_text(smollm2):
    model, tokenizer = smollm2
    responses = list(
        stream_generate(model, tokenizer, chat_ids(tokenizer, "Say hi."), max_tokens=64)
    )
    last = responses[-1]
    assert last.finish_reason == "stop"
    assert last.token in tokenizer.eos_token_ids
    assert "<|im_end|>" not in "".join(r.text for r in responses)


def test_stop_string_ends_output_before_it(smollm2):
    model, tokenizer = smollm2
    prompt = chat_ids(tokenizer, "Count from 1 to 10, separated by commas.")
    full = generate(model, tokenizer, prompt, max_tokens=40)
    assert "5" in full
    cut = generate(model, tokenizer, prompt, max_tokens=40, stop=["5"])
    assert cut == full[: full.index("5")]


def test_sampling_is_reproducible_with_a_seed_and_varies_without(smollm2):
    model, tokenizer = smollm2
    prompt = chat_ids(tokenizer, "Write a random word.")
    a = generate(model, tokenizer, prompt, max_tokens=16, temp=1.0, seed=7)
    b = generate(model, tokenizer, prompt, max_tokens=16, temp=1.0, seed=7)
    others = {
        generate(model, tokenizer, prompt, max_tokens=16, temp=1.0, seed=s) for s in (1, 2, 3)
    }
    assert a == b
    assert len(others | {a}) > 1


@pytest.mark.parametrize(
    "pieces, stop, expected",
    [
        (["Hel", "lo wor", "ld"], ["wor"], ("Hello ", True)),
        (["ab", "c"], ["cd"], ("abc", False)),
        (["x<", "/s", ">y"], ["</s>"], ("x", True)),
    ],
)
def test_stop_matcher_holds_back_possible_prefixes(pieces, stop, expected):
    matcher = _StopMatcher(stop)
    out, stopped = "", False
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out += text
        if stopped:
            break
    if not stopped:
        out += matcher.flush()
    assert (out, stopped) == expected


def test_empty_prompt_and_bad_max_tokens_are_rejected(smollm2):
    model, tokenizer = smollm2
    with pytest.raises(ValueError):
        list(stream_generate(model, tokenizer, [], max_tokens=4))
    with pytest.raises(ValueError):
        list(stream_generate(model, tokenizer, "hi", max_tokens=0))
