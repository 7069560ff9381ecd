"""KV caches: the one builder bounds every layer, the sliding window rolls back exactly, the
prefill is chunked. References: mlx-lm's ``RotatingKVCache`` fed one token at a time, plain
greedy decoding without a bound, and the arrays' own sizes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from llama_toys import tiny_llama
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlxspec.cache import WindowKVCache, make_cache, prefill
from mlxspec.chat import ChatSession
from mlxspec.generate import stream_generate
from mlxspec.speculative import PromptLookupDrafter

# -- the sliding-window cache --------------------------------------------------------------------


def attend(queries, keys, values, mask):
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.5, mask=mask)


def test_window_cache_gives_each_query_the_window_of_a_one_token_step():
    """Chunks, rollbacks and conversions of a WindowKVCache reproduce RotatingKVCache's one-token
    steps (keep=4 attention sinks, window 16) for every query."""
    mx.random.seed(0)
    n, shape = 70, (1, 2, 70, 8)
    keys, values, queries = (mx.random.normal(shape) for _ in range(3))
    rotating, expected = RotatingKVCache(max_size=16, keep=4), []
    for t in range(n):
        k, v = rotating.update_and_fetch(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        expected.append(attend(queries[:, :, t : t + 1], k, v, None))
    expected = mx.concatenate(expected, axis=2)

    window, t = WindowKVCache(max_size=16, keep=4, slack=8), 0
    for chunk, rollback in [(5, 0), (9, 3), (1, 0), (7, 7), (7, 2), (30, 0), (4, 4), (12, 5)]:
        end = min(t + chunk, n)
        mask = window.make_mask(end - t)
        k, v = window.update_and_fetch(keys[:, :, t:end], values[:, :, t:end])
        got = attend(queries[:, :, t:end], k, v, mask)
        np.testing.assert_allclose(np.array(got), np.array(expected[:, :, t:end]), atol=1e-5)
        assert window.trim(rollback) == rollback
        t = end - rollback
    # Back to mlx-lm's cache type; one-token steps continue exactly.
    back = RotatingKVCache(max_size=16, keep=4)
    window.to_rotating(back)
    for s in range(t, n):
        k, v = back.update_and_fetch(keys[:, :, s : s + 1], values[:, :, s : s + 1])
        got = attend(queries[:, :, s : s + 1], k, v, None)
        np.testing.assert_allclose(np.array(got), np.array(expected[:, :, s : s + 1]), atol=1e-5)






def test_make_cache_bounds_every_full_attention_layer_of_llama():
    model = tiny_llama()
    assert all(type(c) is KVCache for c in make_cache(model))  # llama defines make_cache
    bounded = make_cache(model, 32)
    assert all(isinstance(c, RotatingKVCache) and c.max_size == 32 and c.keep == 4 for c in bounded)


def stored_tokens(cache) -> int:
    """Tokens a layer's arrays really hold (not its offset)."""
    return max(c.keys.shape[2] for c in cache)


def test_max_kv_size_bounds_the_cache_of_plain_and_speculative_generation():
    """The contract: with max_kv_size, no layer stores more than that many tokens (llama, whose
    own make_cache mlx-lm's make_prompt_cache returns unbounded), and the output equals
    mlx-lm's own decoding with the same window while differing from the unbounded one."""
    model = tiny_llama()
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 9, 8, 1, 2, 3]
    window = 24
    cache = make_cache(model, window)
    expected = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=80,
                                            prompt_cache=cache)]
    assert stored_tokens(cache) <= window
    unbounded = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=80)]
    assert expected != unbounded  # the window changes the output: it is real
    for options in [{}, {"prompt_lookup": True, "num_draft_tokens": 3}]:
        got = [r.token for r in stream_generate(model, _NoTokenizer(), prompt, max_tokens=80,
                                                max_kv_size=window, **options)]
        assert got == expected, options
        cache = make_cache(model, window)
        list(stream_generate(model, _NoTokenizer(), prompt, max_tokens=80, prompt_cache=cache,
                             **options))
        assert stored_tokens(cache) <= window and cache[0].offset > 3 * window
        assert all(type(c) is RotatingKVCache for c in cache)


def test_chat_with_max_kv_size_keeps_a_bounded_cache(smollm2):
    model, tokenizer = smollm2
    session = ChatSession(model, tokenizer, max_kv_size=32, max_tokens=12)
    for turn in ["Tell me about owls.", "And about cats?"]:
        session.reply(turn)
        assert stored_tokens(session.cache) <= 32
    assert session.cache[0].offset > 32


def test_prefill_in_chunks_equals_one_forward():
    model = tiny_llama()
    tokens = mx.array(np.random.default_rng(0).integers(0, 64, 300), mx.int32)
    whole, chunked = make_cache(model), make_cache(model)
    model(tokens[None], cache=whole)
    seen = []
    prefill(model, chunked, tokens, step_size=64, progress=lambda done, total: seen.append(done))
    assert seen[-1] == 300 and all(b > a for a, b in zip(seen, seen[1:], strict=False))
    assert max(b - a for a, b in zip([0, *seen], seen, strict=False)) <= 64
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(np.array(a.state[0]), np.array(b.state[0]), atol=1e-4)


def test_prompt_lookup_drafter_survives_a_window_rollback():
    model = tiny_llama()
    prompt = [1, 2, 3, 4] * 12
    cache = make_cache(model, 24)
    out = [r.token for r in stream_generate(model, _NoTokenizer(), prompt, max_tokens=40,
                                           prompt_cache=cache, draft=PromptLookupDrafter(),
                                           num_draft_tokens=4)]
    expected = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=40,
                                            prompt_cache=make_cache(model, 24))]
    assert out == expected


class _NoTokenizer:
    """Just enough of a TokenizerWrapper for ids in, ids out."""

    eos_token_ids: list[int] = []
    bos_token = None

    class detokenizer:  # noqa: N801
        last_segment = ""

        @staticmethod
        def reset():
            pass

        @staticmethod
        def add_token(token):
            pass

        @staticmethod
        def finalize():
            pass
