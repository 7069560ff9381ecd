"""The generation API: greedy decoding against an independent loop, stop strings, seeds, EOS."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import TextStateMachine

from mlxspec.generate import generate, stop_text_state, stream_generate


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
    a = generate(model, tokenizer, prompt, max_tokens=10, temp=1.0, seed=7)
    b = generate(model, tokenizer, prompt, max_tokens=10, temp=1.0, seed=7)
    others = {generate(model, tokenizer, prompt, max_tokens=10, temp=1.0, seed=s) for s in (1, 2)}
    assert a == b
    assert len(others | {a}) > 1


@pytest.mark.parametrize(
    "pieces, stop, expected",
    [
        (["Hel", "lo wor", "ld"], ["wor"], ("Hello ", True)),
        (["ab", "c"], ["cd"], ("abc", False)),
        (["x<", "/s", ">y"], ["</s>"], ("x", True)),
        (["a b c"], ["c", "b"], ("a ", True)),  # the earliest stop string in the text wins
        (["abc"], ["", "z"], ("abc", False)),  # an empty stop string stops nothing
    ],
)
def test_stop_strings_hold_back_possible_prefixes(pieces, stop, expected):
    state = stop_text_state(stop)
    out, stopped = "", False
    for piece in pieces:
        state, text, name = TextStateMachine.step(state, piece)
        out += text
        stopped = name is None
        if stopped:
            break
    if not stopped:
        out += TextStateMachine.flush(state)[1]
    assert (out, stopped) == expected


def test_empty_prompt_and_bad_max_tokens_are_rejected(smollm2):
    model, tokenizer = smollm2
    from mlxspec.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="empty"):
        list(stream_generate(model, tokenizer, [], max_tokens=4))
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        list(stream_generate(model, tokenizer, "hi", max_tokens=0))


# -- the API boundary: typed one-line errors, before any work --------------------------------


def toy(vocab: int = 256, context: int | None = None, hidden: int = 32):
    """A tiny random llama (tests/llama_toys.py) with this test module's defaults."""
    from llama_toys import tiny_llama

    return tiny_llama(0, vocab=vocab, hidden=hidden, context=context)


class IdsTokenizer:
    """Just enough of a TokenizerWrapper for token ids in and out (no text)."""

    eos_token_ids: list[int] = []
    bos_token = None

    def __init__(self):
        self.detokenizer = self

    def reset(self):
        self.last_segment = ""

    def add_token(self, token):
        self.last_segment = ""

    def finalize(self):
        self.last_segment = ""


def ids(model, prompt, **kwargs) -> list[int]:
    return [r.token for r in stream_generate(model, IdsTokenizer(), prompt, **kwargs)]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(temp=float("nan")), "temp"),
        (dict(temp=-0.5), "temp"),
        (dict(temp=float("inf")), "temp"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=10**23), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(prompt_lookup=True, num_draft_tokens=0), "num_draft_tokens"),
        (dict(prompt_lookup=True, num_draft_tokens="many"), "num_draft_tokens"),
        (dict(kv_bits=4, max_kv_size=64), "kv_bits"),
        (dict(prefill_step_size=0), "prefill_step_size"),
    ],
)
def test_out_of_range_arguments_raise_a_one_line_typed_error(kwargs, name):
    from mlxspec.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=name) as error:
        ids(toy(), [1, 2, 3], max_tokens=kwargs.pop("max_tokens", 4), **kwargs)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("prompt", [[10**9, 5], [256, 5], [300, 5], [-1, 5], [1.5, 2]])
def test_token_ids_outside_the_embedding_are_refused(prompt):
    """[10**9, 5] segfaulted; [300, 5] on a 256-row embedding read out of bounds."""
    from mlxspec.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="token id|whole numbers"):
        ids(toy(vocab=256), prompt, max_tokens=2)
    assert len(ids(toy(vocab=256), [255, 5], max_tokens=2)) == 2


def test_a_prompt_beyond_the_context_is_refused_unless_a_window_is_asked_for():
    from mlxspec.errors import InvalidArgumentError

    model = toy(context=64)
    with pytest.raises(InvalidArgumentError, match="context of 64 tokens.*max_kv_size"):
        ids(model, list(range(1, 60)), max_tokens=10)
    assert len(ids(model, list(range(1, 60)), max_tokens=5)) == 5  # 59 + 5 fits
    assert len(ids(model, list(range(1, 60)), max_tokens=10, max_kv_size=32)) == 10


def test_same_seed_same_text_with_or_without_speculation_whatever_k():
    """A key per absolute position: plain decoding, prompt lookup at any k and auto-k give the
    same tokens for the same seed (and other seeds give other tokens)."""
    from mlxspec.speculative import DraftModelDrafter

    model = toy(vocab=32)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    options = dict(max_tokens=40, temp=0.9, top_k=8, seed=7)
    plain = ids(model, prompt, **options)
    for k in (1, 3, "auto"):
        assert ids(model, prompt, prompt_lookup=True, num_draft_tokens=k, **options) == plain, k
        draft = DraftModelDrafter(toy(vocab=32), vocab_size=32, real_vocab=32)
        assert ids(model, prompt, draft=draft, num_draft_tokens=k, **options) == plain, k
    assert ids(model, prompt, **{**options, "seed": 8}) != plain


def test_generation_speed_counts_every_pass_after_the_prefill():
    """The speed line once divided by the time after the first yielded token (4662 tok/s): the
    time from the end of the prefill contains every pass, so it cannot beat the passes' own."""
    from mlxspec.speculative import DraftModelDrafter

    model = toy(vocab=32)
    self_draft = DraftModelDrafter(model, vocab_size=32, real_vocab=32)  # always right
    *_, last = stream_generate(model, IdsTokenizer(), [1, 2, 3], max_tokens=8, draft=self_draft,
                               num_draft_tokens=7)
    stats = last.spec_stats
    assert stats.target_passes == 1 and stats.generated == 8  # all 8 tokens from one pass
    assert last.generation_tps <= 1.02 * stats.generated / (stats.draft_seconds + stats.verify_seconds)


@pytest.mark.parametrize("spec", [{}, {"prompt_lookup": True}])
def test_prompt_progress_is_reported_in_chunks_up_to_the_whole_prompt(spec):
    model = toy(vocab=32)
    seen = []
    ids(model, list(range(1, 31)) * 10, max_tokens=3, prefill_step_size=64,
        prompt_progress_callback=lambda done, total: seen.append((done, total)), **spec)
    assert seen[-1] == (300, 300) and all(total == 300 for _, total in seen)
    steps = [b - a for (a, _), (b, _) in zip(seen, seen[1:], strict=False)]
    assert all(0 <= s <= 64 for s in steps) and len(seen) >= 5


def test_quantized_kv_cache_with_and_without_speculation_equals_mlx_lm():
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache

    from mlxspec.cache import make_cache

    model = toy(vocab=32, hidden=128)  # head_dim 32: one quantization group
    prompt = [1, 2, 3, 4, 5, 6, 7] * 4
    kv = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=8)
    expected = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=30, **kv)]
    for spec in [{}, {"prompt_lookup": True, "num_draft_tokens": 3}]:
        cache = make_cache(model)
        got = [r.token for r in stream_generate(model, IdsTokenizer(), prompt, max_tokens=30,
                                                prompt_cache=cache, **kv, **spec)]
        assert got == expected, spec
        assert all(isinstance(c, QuantizedKVCache) for c in cache)


def test_a_plain_stretch_quantizes_the_kv_cache_as_it_crosses_the_start():
    """Speculative decoding's plain steps (prompt lookup without a match runs them until it
    finds one) quantize the cache where generate_step does, at the step that crosses
    ``quantized_kv_start``, not after the stretch."""
    from mlx_lm.generate import generate_step

    from mlxspec.cache import make_cache

    model = toy(vocab=32, hidden=128)
    prompt = [1, 2, 3]  # nothing repeats: lookup has no match, a long plain stretch
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=6)
    expected = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=40, **kv)]
    unquantized = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=40)]
    assert expected != unquantized  # the 4-bit cache changes the text: the test can tell
    got = [r.token for r in stream_generate(model, IdsTokenizer(), prompt, max_tokens=40,
                                            prompt_cache=make_cache(model), prompt_lookup=True,
                                            num_draft_tokens="auto", **kv)]
    assert got == expected


def test_a_verify_pass_ends_where_the_kv_cache_is_quantized():
    """A pass's rows after the one that brings the cache to ``quantized_kv_start`` attend to
    keys generate_step has quantized by then: the pass ends at that row (k = 6 otherwise
    verifies across it and the text differs from token 15 on)."""
    from mlx_lm.generate import generate_step

    from mlxspec.cache import make_cache

    model = toy(vocab=32, hidden=128)
    prompt = [1, 2, 3, 4, 5, 6, 7] * 4  # lookup matches: long drafts
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=40)
    expected = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=40, **kv)]
    unquantized = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=40)]
    assert expected != unquantized
    got = [r.token for r in stream_generate(model, IdsTokenizer(), prompt, max_tokens=40,
                                            prompt_cache=make_cache(model), prompt_lookup=True,
                                            num_draft_tokens=6, **kv)]
    assert got == expected


@pytest.mark.parametrize("spec", [{}, {"prompt_lookup": True, "num_draft_tokens": 4}])
def test_a_long_prompt_quantizes_the_kv_cache_where_mlx_lm_does(spec):
    """mlx-lm quantizes after each ``prefill_step_size`` chunk of the prompt and after its
    last; mlxspec's prefill chunks differ (they adapt to the speed) but quantize at the same
    points, plain and speculative alike (the speculative prefill quantized after each of its
    own chunks, the plain one only after the prompt: their logits differed by up to 0.34)."""
    import random

    from mlx_lm.generate import generate_step

    from mlxspec.cache import make_cache

    model = toy(vocab=32, hidden=128)
    rng = random.Random(0)
    prompt = [rng.randrange(32) for _ in range(600)]
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0, prefill_step_size=512)
    expected = [(t, lp) for t, lp in generate_step(mx.array(prompt), model, max_tokens=4, **kv)]
    got = [(r.token, r.logprobs) for r in stream_generate(
        model, IdsTokenizer(), prompt, max_tokens=4, prompt_cache=make_cache(model), **kv, **spec)]
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(got, expected, strict=True):
        assert mx.abs(a - b).max().item() < 1e-4


def test_decoding_modules_form_layers_without_import_cycles():
    """sampling and cache are leaves (sampling reaches the CPU backend through its seam only);
    speculative never imports generate or chat; generate never imports chat (module-level
    imports and lazy ones alike)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "mlxspec"

    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        found |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        return {m for m in found if m.startswith("mlxspec")}

    assert imports(root / "sampling.py") <= {"mlxspec.errors", "mlxspec.cpu"}
    assert imports(root / "cache.py") == set()
    for path in (root / "speculative").glob("*.py"):
        assert not imports(path) & {"mlxspec.generate", "mlxspec.chat"}, path.name
    assert "mlxspec.chat" not in imports(root / "generate.py")
