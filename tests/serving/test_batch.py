"""`mlxspec.batch_generate` and `mlxspec batch`: batched output equals one-by-one output, resume."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlxspec.benchmark import model_bytes
from mlxspec.generate import generate
from mlxspec.serving.batch import (
    MIN_SHARED_PREFIX,
    batch_generate,
    choose_batch_size,
    kv_bytes_per_token,
    shared_prefix,
)
from mlxspec.serving.batch_jsonl import run_jsonl
from mlxspec.serving.engine import Engine, Request

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a village by the sea, there lived a small robot who",
    "1, 2, 3, 4,",
    "Water boils at",
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def one_by_one(smollm2):
    """The independent reference: plain single-stream greedy decoding, one prompt at a time."""
    model, tokenizer = smollm2
    return [generate(model, tokenizer, p, max_tokens=MAX_TOKENS) for p in PROMPTS]


def test_batched_greedy_equals_one_by_one_greedy(smollm2, one_by_one):
    model, tokenizer = smollm2
    # batch size 3 < 5 prompts: sequences join the running batch as others finish.
    results = batch_generate(model, tokenizer, PROMPTS, max_tokens=MAX_TOKENS, batch_size=3)
    assert [r.text for r in results] == one_by_one
    assert all(r.error is None and r.completion_tokens == MAX_TOKENS for r in results)
    assert [r.prompt_tokens for r in results] == [len(tokenizer.encode(p)) for p in PROMPTS]


def test_stop_string_ends_a_batched_sequence(smollm2, one_by_one):
    model, tokenizer = smollm2
    stop = one_by_one[1][3:6]  # a string the reference generates
    (result,) = batch_generate(model, tokenizer, PROMPTS[1:2], max_tokens=MAX_TOKENS,
                               stop=[stop], batch_size=2)
    assert result.finish_reason == "stop"
    assert result.text == one_by_one[1][: one_by_one[1].index(stop)]


def test_shared_prefix_is_the_longest_one_all_prompts_start_with():
    long = list(range(100, 100 + MIN_SHARED_PREFIX))
    assert shared_prefix([long + [1, 2], long + [1, 3], long + [1]]) == long + [1]
    assert shared_prefix([long + [1], long]) == long  # one prompt is the prefix itself
    assert shared_prefix([long + [1]]) == []  # one prompt: nothing to share
    assert shared_prefix([long[:-1] + [7], long[:-1] + [8]]) == []  # too short to be worth it
    assert shared_prefix([[5] + long, long]) == []


def _chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True)


def test_a_shared_prefix_is_prefilled_once_and_changes_no_token(smollm2):
    """Chat prompts share their template and system prompt: the engine prefills it once and
    each request only its rest, with plain one-by-one decoding's output (the prompt equal to the
    prefix included: its last token is fed again; a prompt not starting with it reuses nothing)."""
    model, tokenizer = smollm2
    prompts = [_chat(tokenizer, p) for p in PROMPTS[:3]]
    prefix = shared_prefix(prompts)
    assert len(prefix) >= MIN_SHARED_PREFIX and prompts[0][len(prefix)] != prompts[1][len(prefix)]
    prompts += [prefix, tokenizer.encode(PROMPTS[3])]
    reference = [generate(model, tokenizer, p, max_tokens=MAX_TOKENS) for p in prompts]
    engine = Engine(model, tokenizer, max_batch=3, prompt_cache_size=0)
    engine.share_prefix(prefix)
    rids = [engine.submit(Request(p, max_tokens=MAX_TOKENS)) for p in prompts]
    texts, cached = {rid: "" for rid in rids}, {}
    while engine.streams:
        for event in engine.step():
            texts[event.rid] += event.text
            cached[event.rid] = event.cached_tokens
    engine.close()
    assert [texts[rid] for rid in rids] == reference
    assert [cached[rid] for rid in rids] == [len(prefix)] * 3 + [len(prefix) - 1, 0]
    # batch_generate finds the prefix itself and gives the same texts.
    results = batch_generate(model, tokenizer, prompts, max_tokens=MAX_TOKENS, batch_size=2)
    assert [r.text for r in results] == reference


def test_a_shared_prefix_longer_than_a_sliding_window(gemma3):
    """Gemma-3's sliding-window layers keep only their last 512 positions: a shared prefix
    longer than that leaves wrapped caches, and each copy must still continue exactly as the
    whole prompt prefilled alone would (plain one-by-one decoding's texts)."""
    model, tokenizer = gemma3
    examples = "Examples: " + " ".join(f"item{i} = {i * 7 % 13};" for i in range(100))
    prompts = [tokenizer.encode(f"{examples} Now item{i} =") for i in (3, 41, 97)]
    assert len(shared_prefix(prompts)) > 600
    reference = [generate(model, tokenizer, p, max_tokens=MAX_TOKENS) for p in prompts]
    results = batch_generate(model, tokenizer, prompts, max_tokens=MAX_TOKENS, batch_size=2)
    assert [r.text for r in results] == reference


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_job_records_bad_lines_and_resumes(smollm2, one_by_one, tmp_path):
    model, tokenizer = smollm2
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join([
        json.dumps({"id": "p0", "prompt": PROMPTS[0]}),
        json.dumps({"id": "p1", "prompt": PROMPTS[1]}),
        "{not json",
        json.dumps({"id": "empty", "prompt": ""}),
        json.dumps({"id": "p3", "prompt": PROMPTS[3], "max_tokens": 3}),
        json.dumps({"id": "p1", "prompt": PROMPTS[2]}),  # a duplicate id
        json.dumps({"id": "hot", "prompt": PROMPTS[4], "temperature": "hot"}),
    ]) + "\n")
    out = tmp_path / "results.jsonl"
    # A previous run that finished p0 and crashed while appending p1.
    out.write_text(json.dumps({"id": "p0", "text": "from the first run"}) + '\n{"id": "p1", "te')

    summary = run_jsonl(model, tokenizer, src, out, defaults={"max_tokens": MAX_TOKENS},
                        batch_size=2, progress=False)
    records = _lines(out)
    by_id = {r["id"]: r for r in records}
    assert [r["id"] for r in records].count("p0") == 1
    assert by_id["p0"]["text"] == "from the first run"  # skipped, not regenerated
    assert by_id["p1"]["text"] == one_by_one[1]
    assert by_id["p3"]["text"] == generate(model, tokenizer, PROMPTS[3], max_tokens=3)
    assert "not JSON" in by_id["line-3"]["error"]
    assert "prompt" in by_id["empty"]["error"]
    assert "duplicate id" in by_id["line-6"]["error"]
    assert "temperature" in by_id["hot"]["error"]
    assert summary["completed"] == 2 and summary["errors"] == 4 and summary["skipped"] == 1

    again = run_jsonl(model, tokenizer, src, out, batch_size=2, progress=False)
    assert again["skipped"] == again["total"] and _lines(out) == records


def test_batch_command_writes_results(smollm2_dir, one_by_one, tmp_path):
    from mlxspec.cli.main import cli

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                           for i, p in enumerate(PROMPTS[:2])))
    result = CliRunner().invoke(cli, ["batch", str(src), "--out", str(out), "--model",
                                      str(smollm2_dir), "--max-tokens", str(MAX_TOKENS)])
    assert result.exit_code == 0, result.output
    texts = {r["id"]: r["text"] for r in _lines(out)}
    assert texts == {"0": one_by_one[0], "1": one_by_one[1]}


def test_batch_size_is_capped_by_memory(smollm2):
    model, _ = smollm2
    per_sequence = kv_bytes_per_token(model) * 100
    config = model.args
    assert per_sequence == 100 * 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 4  # float32 keys and values
    memory = int((model_bytes(model) + 2.5 * per_sequence) / 0.6)
    size, report = choose_batch_size(model, tokens_per_sequence=100, num_prompts=64, memory=memory)
    assert report["memory_cap"] == 2 and size <= 2
    assert set(report["tokens_per_s"]) <= {"1", "2"}
