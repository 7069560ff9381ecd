"""Chat sessions reuse the KV cache across turns and still reply exactly as a fresh prefill."""

from __future__ import annotations

from mlxspec.chat import ChatSession
from mlxspec.generate import generate

TURNS = ["My name is Ada and I like owls.", "What is my name?", "And what animal do I like?"]


def fresh_reply(model, tokenizer, messages, system=None, max_tokens=32):
    """The reply to the conversation prefilled from scratch, with no reused cache."""
    full = ([{"role": "system", "content": system}] if system else []) + messages
    ids = list(tokenizer.apply_chat_template(full, add_generation_prompt=True))
    return generate(model, tokenizer, ids, max_tokens=max_tokens)


def test_cached_turns_equal_fresh_prefill_and_only_new_tokens_are_prefilled(smollm2):
    model, tokenizer = smollm2
    session = ChatSession(model, tokenizer, max_tokens=16)
    for i, turn in enumerate(TURNS):
        before = session.messages + [{"role": "user", "content": turn}]
        reply = session.reply(turn)
        assert reply == fresh_reply(model, tokenizer, before, max_tokens=16)
        total = len(session.conversation_tokens(add_generation_prompt=False))
        if i > 0:  # later turns prefill only their own tokens, not the history
            assert session.prefilled_tokens < total / 2


def test_interrupted_reply_keeps_the_conversation_consistent(smollm2):
    model, tokenizer = smollm2
    session = ChatSession(model, tokenizer, max_tokens=40)
    stream = session.stream_reply("Tell me about the moon.")
    for _ in range(5):
        next(stream)
    stream.close()  # what Ctrl-C does in the CLI
    assert session.messages[-1]["role"] == "assistant"
    reply = session.reply("Thanks. Now one word about the sun.")
    assert reply == fresh_reply(
        model,
        tokenizer,
        session.messages[:-1]
        + [{"role": "user", "content": "Thanks. Now one word about the sun."}],
        max_tokens=40,
    )


def test_system_prompt_change_and_reset(smollm2):
    model, tokenizer = smollm2
    session = ChatSession(model, tokenizer, system="You answer in French.", max_tokens=16)
    reply = session.reply("Say good morning.")
    assert reply == fresh_reply(
        model,
        tokenizer,
        [{"role": "user", "content": "Say good morning."}],
        system="You answer in French.",
        max_tokens=16,
    )
    session.set_system("You answer in German.")
    reply = session.reply("Say good night.")
    assert reply == fresh_reply(
        model, tokenizer, session.messages[:-1], system="You answer in German.", max_tokens=16
    )
    session.reset()
    assert session.messages == [] and session.cached_tokens == []


def test_rotating_cache_chat_matches_fresh_prefill_with_the_same_window(smollm2):
    model, tokenizer = smollm2
    session = ChatSession(model, tokenizer, max_kv_size=64, max_tokens=24)
    for turn in TURNS[:2]:
        before = session.messages + [{"role": "user", "content": turn}]
        reply = session.reply(turn)
        ids = list(tokenizer.apply_chat_template(before, add_generation_prompt=True))
        assert reply == generate(model, tokenizer, ids, max_tokens=24, max_kv_size=64)


def test_chat_prompt_renders_the_template_once_for_everyone(smollm2):
    from mlxspec.chat_template import chat_prompt

    _, tokenizer = smollm2
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = chat_prompt(tokenizer, messages)
    assert ids == list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    without = chat_prompt(tokenizer, messages, add_generation_prompt=False)
    assert ids[: len(without)] == without and len(ids) > len(without)


def test_a_refused_turn_leaves_the_conversation_as_it_was(smollm2):
    import pytest

    from mlxspec.errors import InvalidArgumentError

    model, tokenizer = smollm2
    session = ChatSession(model, tokenizer, max_tokens=12)
    first = session.reply(TURNS[0])
    with pytest.raises(InvalidArgumentError, match="context"):
        session.reply("Tell me everything.", max_tokens=10**6)
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    before = session.messages + [{"role": "user", "content": TURNS[1]}]
    assert session.reply(TURNS[1]) == fresh_reply(model, tokenizer, before, max_tokens=12)
    assert first
