"""The batch's greedy shortcut (`mlxspec.serving.rows`): the argmax of the raw logits is used only
where it is the argmax of the log-probabilities (mlx-lm's greedy step); near-ties are normalized."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxspec.serving.decode_batch as engine_batch
import mlxspec.serving.rows as engine_rows
from mlxspec.cache import make_cache
from mlxspec.generate import generate
from mlxspec.serving.batch import batch_generate
from mlxspec.serving.engine import Engine
from mlxspec.serving.requests import Request
from mlxspec.serving.rows import greedy_candidates, greedy_tokens

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Water boils at"]
MAX_TOKENS = 6


def wrong_and_flagged(logits: mx.array) -> tuple[mx.array, mx.array]:
    """A broken shortcut for the tests: every token wrong, every row flagged as a near-tie."""
    top = (mx.argmax(logits, axis=-1) + 1) % logits.shape[-1]
    return top.astype(mx.uint32), mx.full(top.shape, 2, mx.int32)


def normalized_argmax(logits: mx.array) -> list[int]:
    """mlx-lm's greedy token: the argmax of logits - logsumexp(logits)."""
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1).tolist()


def test_greedy_tokens_equal_the_argmax_of_log_probabilities():
    rng = np.random.default_rng(0)
    vocabulary = 49152
    # Rows 0-15: spread logits (the top one stands out). Rows 16-47: flat logits (log-probabilities
    # near -log(vocabulary), where float32 is 250x coarser than at the logits), with an earlier
    # index planted 0-5 float32 steps below the top: normalizing can merge the two.
    logits = np.concatenate([rng.normal(0, 4, (16, vocabulary)),
                             rng.normal(0, 0.01, (32, vocabulary))]).astype(np.float32)
    for row in range(16, 48):
        top = int(np.argmax(logits[row]))
        if top == 0:
            logits[row, [0, 1]] = logits[row, [1, 0]]
            top = 1
        earlier = int(rng.integers(0, top))
        value = logits[row, top]
        for _ in range((row - 16) % 6):
            value = np.nextafter(value, np.float32(-np.inf))
        logits[row, earlier] = value
    logits = mx.array(logits)

    top, near = greedy_candidates(logits)
    want = normalized_argmax(logits)
    assert greedy_tokens(logits, top, near).tolist() == want
    # The check is needed: on some rows the raw argmax is not mlx-lm's token ...
    assert any(t != w for t, w in zip(top.tolist(), want, strict=True))
    # ... and rows without a near-tie take the shortcut.
    assert near.tolist()[:16] == [1] * 16


def test_greedy_tokens_of_degenerate_rows_are_mlx_lms():
    """Rows with NaN, +inf or only -inf logits go through the normalization, as in mlx-lm."""
    inf, nan = float("inf"), float("nan")
    logits = mx.array([[0.0, 1.0, nan, 0.5], [0.0, inf, 1.0, 2.0], [-inf, -inf, -inf, -inf],
                       [0.0, 3.0, 1.0, 2.0]])
    top, near = greedy_candidates(logits)
    assert near.tolist()[3] == 1 and all(n != 1 for n in near.tolist()[:3])
    assert greedy_tokens(logits, top, near).tolist() == normalized_argmax(logits)


@pytest.fixture(scope="module")
def one_by_one(smollm2):
    model, tokenizer = smollm2
    return [generate(model, tokenizer, p, max_tokens=MAX_TOKENS) for p in PROMPTS]


def test_batch_takes_the_shortcut_and_matches_plain_decoding(smollm2, one_by_one, monkeypatch):
    model, tokenizer = smollm2
    calls = []
    original = engine_rows.greedy_candidates
    monkeypatch.setattr(engine_rows, "greedy_candidates",
                        lambda logits: calls.append(logits.shape) or original(logits))
    results = batch_generate(model, tokenizer, PROMPTS, max_tokens=MAX_TOKENS, batch_size=3)
    assert [r.text for r in results] == one_by_one
    assert calls, "a greedy batch without logprobs should skip the normalization"


@pytest.mark.parametrize("rewind", [True, False], ids=["caches-step-back", "checked-first"])
def test_every_flagged_row_is_settled_before_its_token_is_used(smollm2, one_by_one, monkeypatch,
                                                               rewind):
    """The shortcut's tokens made wrong on purpose and every row flagged as a near-tie: the
    output is still plain decoding's, so each flagged token is replaced before its forward
    counts (redone after stepping the caches back, or checked first when they cannot step
    back), through rows finishing (filter) and joining (extend) the batch."""
    from mlx_lm.models.cache import BatchKVCache

    model, tokenizer = smollm2
    if not rewind:
        monkeypatch.setattr(BatchKVCache, "is_trimmable", lambda self: False)
        monkeypatch.setattr(BatchKVCache, "trim", lambda self, n: pytest.fail("trimmed"))
    trims = []
    if rewind:
        trim = BatchKVCache.trim
        monkeypatch.setattr(BatchKVCache, "trim", lambda self, n: trims.append(n) or trim(self, n))

    monkeypatch.setattr(engine_rows, "greedy_candidates", wrong_and_flagged)
    results = batch_generate(model, tokenizer, PROMPTS, max_tokens=MAX_TOKENS, batch_size=3)
    assert [r.text for r in results] == one_by_one
    assert bool(trims) == rewind


def test_rows_reporting_logprobs_are_normalized(smollm2, monkeypatch):
    model, tokenizer = smollm2
    calls = []
    monkeypatch.setattr(engine_rows, "greedy_candidates",
                        lambda logits: calls.append(1) or pytest.fail("shortcut with logprobs"))
    engine = Engine(model, tokenizer, max_batch=4, prompt_cache_size=0)
    rids = [engine.submit(Request(prompt=tokenizer.encode(p), max_tokens=4, logprobs=True))
            for p in PROMPTS[:2]]
    events = []
    while engine.streams:
        events += engine.step()
    assert {e.rid for e in events} == set(rids)
    logprobs = [e.logprob for e in events if e.token is not None]
    assert logprobs and all(lp is not None and lp <= 0 for lp in logprobs)
    assert not calls


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_last_token_logits_equal_the_full_forward(name, request, monkeypatch):
    """Prompts of different lengths, right-padded as the batch pads them: the logits at each
    row's last token and the caches left behind match a full forward's, and the output head ran
    on one position per row."""
    from mlxspec.cache import make_cache

    model, tokenizer = request.getfixturevalue(name)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    lengths = [len(p) for p in prompts]
    tokens = mx.array([p + [0] * (max(lengths) - len(p)) for p in prompts])
    full_cache, cache = make_cache(model), make_cache(model)
    full = model(tokens, cache=full_cache)[mx.arange(3), mx.array(lengths) - 1]

    seen = []
    norm = model.model.norm
    call = type(norm).__call__

    def recording(self, x):
        if self is norm:
            seen.append(x.shape)
        return call(self, x)

    monkeypatch.setattr(type(norm), "__call__", recording)
    last = engine_batch.last_token_logits(model, tokens, cache, lengths)
    monkeypatch.undo()

    assert last.shape == full.shape
    np.testing.assert_allclose(np.array(last), np.array(full), rtol=1e-4, atol=1e-4)
    assert mx.argmax(last, axis=-1).tolist() == mx.argmax(full, axis=-1).tolist()
    assert seen == [(3, 1, model.model.norm.weight.shape[0])]
    assert model.model.norm is norm  # the model is left as it was
    for mine, theirs in zip(cache, full_cache, strict=True):
        for a, b in zip(mine.state, theirs.state, strict=True):
            assert mx.array_equal(a, b)


@pytest.mark.parametrize("flagged", [False, True], ids=["shortcut", "all-flagged"])
def test_a_row_leaving_after_rows_joined_leaves_the_others_tokens(smollm2, one_by_one,
                                                                  monkeypatch, flagged):
    """Rows join after a shortcut step (its check covers the rows before them), then an earlier
    row is cancelled before the next step: every remaining row still decodes plain decoding's
    text (the check must be cut to the rows it covers, not indexed past them)."""
    model, tokenizer = smollm2
    if flagged:
        monkeypatch.setattr(engine_rows, "greedy_candidates", wrong_and_flagged)
    engine = Engine(model, tokenizer, max_batch=8, prompt_cache_size=0)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    texts: dict[int, str] = {}

    def step() -> None:
        for e in engine.step():
            texts[e.rid] = texts.get(e.rid, "") + e.text

    leaving = engine.submit(Request(prompt=prompts[0], max_tokens=50))
    kept = {engine.submit(Request(prompt=prompts[1], max_tokens=MAX_TOKENS)): 1}
    step()
    step()
    kept.update({engine.submit(Request(prompt=prompts[i], max_tokens=MAX_TOKENS)): i
                 for i in (2, 3)})
    step()  # they join after this step's forward
    engine.cancel(leaving)
    while engine.streams:
        step()
    assert {rid: texts[rid] for rid in kept} == {rid: one_by_one[i] for rid, i in kept.items()}


@pytest.mark.parametrize("flagged", [False, True], ids=["shortcut", "all-flagged"])
def test_joining_rows_take_the_slots_of_rows_that_left(smollm2, monkeypatch, flagged):
    """A finished row stays in the batch's caches, retired, and the next row to join is written
    into its slot instead of the caches being copied; a prompt longer than the batch's caches
    compacts them first. Every request's text is plain decoding's, whatever slot it decoded in
    and whatever decoded there before (all-flagged: every step's tokens settled, slots too)."""
    model, tokenizer = smollm2
    if flagged:
        monkeypatch.setattr(engine_rows, "greedy_candidates", wrong_and_flagged)
    placed, compacted = [], []
    place, compact = engine_rows.BatchRows._place, engine_rows.BatchRows._compact
    monkeypatch.setattr(engine_rows.BatchRows, "_place", lambda self, slots, batch: (
        placed.append(list(slots)), place(self, slots, batch))[1])
    monkeypatch.setattr(engine_rows.BatchRows, "_compact", lambda self, keep: (
        compacted.append(len(keep)), compact(self, keep))[1])
    long_prompt = " ".join(f"item{i}," for i in range(40))
    queue = [(PROMPTS[i % 4], n) for i, n in enumerate([3, 9, 5, 12, 4, 7, 10, 6, 8, 5])]
    queue.insert(7, (long_prompt, 4))
    expected = {}
    engine = Engine(model, tokenizer, max_batch=8, prompt_cache_size=0)
    texts: dict[int, str] = {}

    def submit() -> None:
        prompt, max_tokens = queue.pop(0)
        rid = engine.submit(Request(prompt=tokenizer.encode(prompt), max_tokens=max_tokens))
        expected[rid], texts[rid] = generate(model, tokenizer, prompt, max_tokens=max_tokens), ""

    for _ in range(5):
        submit()
    finished, later = 0, []  # every other finish: its successor comes after one more step
    while engine.streams or later:
        for _ in range(min(later.count(0), len(queue))):
            submit()
        later = [n - 1 for n in later if n > 0]
        for event in engine.step():
            texts[event.rid] += event.text
            if event.finish_reason is not None:
                finished += 1
                later.append(finished % 2)
        for c in engine.batch.rows.prompt_cache:  # grown in KV_STEP positions, not mlx-lm's 256
            assert c.step == engine_batch.KV_STEP != 256
    assert texts == expected
    assert placed and compacted  # slots were taken, and the long prompt compacted the batch


def test_a_long_row_leaving_drops_the_padding_the_others_shared(smollm2, monkeypatch):
    """A long row leaves while shorter ones, right-aligned to it, keep decoding: once every live
    row's cache starts with ``TRIM_PADDING`` empty positions the batch is compacted (mlx-lm's
    ``filter`` drops them) instead of the row being retired, and nobody's text changes."""
    model, tokenizer = smollm2
    compacted = []
    compact = engine_rows.BatchRows._compact
    monkeypatch.setattr(engine_rows.BatchRows, "_compact", lambda self, keep: (
        compacted.append(len(keep)), compact(self, keep))[1])
    long_prompt = " ".join(f"item{i}," for i in range(30))
    assert len(tokenizer.encode(long_prompt)) > engine_rows.TRIM_PADDING + 10
    requests = [(long_prompt, 2), (PROMPTS[0], 10), (PROMPTS[1], 10)]
    engine = Engine(model, tokenizer, max_batch=8, prompt_cache_size=0)
    rids = {engine.submit(Request(prompt=tokenizer.encode(p), max_tokens=n)): (p, n)
            for p, n in requests}
    texts = dict.fromkeys(rids, "")
    shared_padding = []
    while engine.streams:
        for event in engine.step():
            texts[event.rid] += event.text
        rows = engine.batch.rows
        if rows.live() == 2 and len(rows):
            padding = rows.prompt_cache[0].left_padding.tolist()
            shared_padding.append(min(p for p, uid in zip(padding, rows.uids, strict=True)
                                      if uid != engine_rows.RETIRED))
    assert compacted[0] == 2  # the long row left: the two short rows compacted, not retired
    assert shared_padding and max(shared_padding) < engine_rows.TRIM_PADDING
    assert texts == {rid: generate(model, tokenizer, p, max_tokens=n) for rid, (p, n) in rids.items()}


def test_a_leaving_rows_cached_keys_and_values_are_its_own(smollm2, monkeypatch):
    """A row leaving the batch (retired in place, its slot taken by the next row) puts its cache
    in the prefix cache: the row's own keys and values, those of its tokens run alone through
    the model (float32), the batch's padding and right-alignment gone."""
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, max_batch=8)
    queue = [(PROMPTS[0], 3), (PROMPTS[1], 9), (PROMPTS[2], 5), ("Once upon a time", 7),
             (PROMPTS[3], 4)]
    tokens = {}

    def submit() -> None:
        prompt, max_tokens = queue.pop(0)
        rid = engine.submit(Request(prompt=tokenizer.encode(prompt), max_tokens=max_tokens))
        tokens[rid] = tokenizer.encode(prompt)

    for _ in range(3):
        submit()
    placed = []
    place = engine_rows.BatchRows._place
    monkeypatch.setattr(engine_rows.BatchRows, "_place", lambda self, slots, batch: (
        placed.append(list(slots)), place(self, slots, batch))[1])
    while engine.streams:
        for event in engine.step():
            if event.token is not None:
                tokens[event.rid].append(event.token)
            if event.finish_reason is not None and queue:
                submit()
    assert placed  # later rows decoded in the slots of rows that left
    for rid, row_tokens in tokens.items():
        cache, rest = engine.prompt_cache.fetch_nearest_cache(id(model), row_tokens)
        assert cache is not None and rest == [], rid
        alone = make_cache(model)
        model(mx.array(row_tokens)[None], cache=alone)
        for got, want in zip(cache, alone, strict=True):
            assert got.offset == want.offset == len(row_tokens)
            for a, b in ((got.keys, want.keys), (got.values, want.values)):
                np.testing.assert_allclose(np.array(a[..., : got.offset, :]),
                                           np.array(b[..., : want.offset, :]), atol=2e-4)
