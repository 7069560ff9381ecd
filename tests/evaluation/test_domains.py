"""The built-in multi-domain texts: calibration and evaluation never share a passage, each domain's
windows are pieces of its own text, and the gate judges the worst domain (checked on a tiny model
made bad on one domain only, against the plain pooled comparison)."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import load_model, load_tokenizer
from tiny_models import make_tiny_model

from mlxspec import evaluation as ev
from mlxspec.evaluation import domains
from mlxspec.quant import calibration_set

DATA = Path(str(files("mlxspec") / "data"))
CALIBRATION_FILES = sorted({n for names in calibration_set.SOURCES.values() for n in names})
EVALUATION_FILES = sorted({n for names in domains.DOMAIN_SOURCES.values() for n in names})


def _shingles(text: str, n: int = 10) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _eval_text(name: str) -> str:
    if name.endswith(".jsonl"):  # the conversations' text
        return "\n".join(m["content"] for c in domains.conversations(name) for m in c)
    return (DATA / name).read_text(encoding="utf-8")


def test_no_evaluation_text_shares_a_passage_with_any_calibration_source():
    calibration = set().union(*(_shingles((DATA / n).read_text(encoding="utf-8"))
                                for n in CALIBRATION_FILES))
    calibration |= _shingles("\n".join(calibration_set.prompts()))
    for name in EVALUATION_FILES:
        shared = _shingles(_eval_text(name)) & calibration
        assert not shared, f"{name} shares {len(shared)} passages, e.g. {' '.join(min(shared))}"


def test_held_out_prompts_are_not_calibration_prompts_and_are_the_chat_texts_prompts():
    held_out = [p for p in (DATA / "eval_prompts.txt").read_text().splitlines() if p]
    assert not set(held_out) & set(calibration_set.prompts())
    conversations = domains.conversations()
    assert [c[0]["content"] for c in conversations] == held_out[: len(conversations)]
    assert all(c[1]["role"] == "assistant" and c[1]["content"] for c in conversations)


def test_every_shipped_text_is_recorded_in_the_provenance_and_the_data_is_small():
    provenance = (DATA / "PROVENANCE.md").read_text()
    shipped = [p for p in DATA.iterdir() if p.suffix in (".txt", ".jsonl")]
    for path in shipped:
        assert path.name in provenance, f"{path.name} has no provenance entry"
    assert sum(p.stat().st_size for p in shipped) < 2_000_000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("domains") / "tiny")
    return path, load_tokenizer(path)


def _is_piece(window: list[int], stream: list[int]) -> bool:
    s, w = np.asarray(stream), np.asarray(window)
    starts = np.flatnonzero(s[: len(s) - len(w) + 1] == w[0])
    return any((s[i : i + len(w)] == w).all() for i in starts)


def test_domain_windows_are_evenly_spread_pieces_of_each_domains_text(tiny):
    _, tokenizer = tiny
    by_domain = ev.domain_windows(tokenizer, windows=3, window_tokens=64)
    assert list(by_domain) == ["prose", "code", "chat", "technical"]  # the byte tokenizer chats
    for domain, windows in by_domain.items():
        stream = domains.domain_ids(tokenizer, domain)
        assert len(windows) == 3 and all(len(w) == 64 for w in windows)
        assert all(_is_piece(w, stream) for w in windows)
        assert windows[0] == stream[:64] and windows[-1] == stream[-64:]  # first and last


def test_builtin_calibration_mixes_every_domain_interleaved(tiny):
    _, tokenizer = tiny
    conversations = [[{"role": "user", "content": q},
                      {"role": "assistant", "content": f"An answer to: {q[::-1]}"}]
                     for q in calibration_set.prompts()[:2]]
    mix = {"prose": 1, "code": 1, "technical": 1, "chat": 1}
    windows, record = calibration_set.mixed_windows(
        tokenizer, conversations=conversations, windows=8, window_tokens=32, mix=mix)
    assert record["calibration"] == "builtin:prose=2,code=2,technical=2,chat=2"
    streams = {d: list(tokenizer.encode("\n\n".join(calibration_set.data_text(n) for n in s),
                                        add_special_tokens=False))
               for d, s in calibration_set.SOURCES.items()}
    streams["chat"] = calibration_set.conversation_tokens(tokenizer, conversations)
    order = ["prose", "code", "technical", "chat"] * 2  # interleaved: every batch sees each
    assert [next(d for d, s in streams.items() if _is_piece(w, s)) for w in windows] == order
    # without a model there is nothing to answer with: the chat share goes to the others
    plain, record = calibration_set.mixed_windows(tokenizer, windows=6, window_tokens=32, mix=mix)
    assert record["calibration"] == "builtin:prose=2,code=2,technical=2" and len(plain) == 6


def test_compare_domains_is_compare_per_domain_and_pooled(tiny, tmp_path):
    path, tokenizer = tiny
    reference = load_model(path)[0]
    model = load_model(path)[0]
    model.model.embed_tokens.weight = model.model.embed_tokens.weight + 0.05 * mx.random.normal(
        model.model.embed_tokens.weight.shape, key=mx.random.key(3))
    by_domain = ev.domain_windows(tokenizer, windows=2, window_tokens=48)
    got = ev.compare_domains(model, reference, by_domain)
    pooled = ev.compare(model, reference, [w for ws in by_domain.values() for w in ws])
    for key in ("kl_mean", "kl_p99", "top1_agreement", "perplexity", "tokens"):
        assert got[key] == pytest.approx(pooled[key], rel=1e-5)
    for domain, windows in by_domain.items():
        alone = ev.compare(model, reference, windows)
        assert got["domains"][domain]["kl_mean"] == pytest.approx(alone["kl_mean"], rel=1e-5)
    worst = max(got["domains"], key=lambda d: got["domains"][d]["kl_mean"])
    assert got["worst"]["domain"] == worst
    json.dumps(got)  # JSON-ready


class _WrongOnSomeTokens(nn.Module):
    """An input embedding that returns another token's row (scaled up) for ``tokens``; the tied
    output head keeps the true table, so text without those tokens is scored exactly."""

    def __init__(self, embedding: nn.Embedding, tokens: list[int]):
        super().__init__()
        self.embedding = embedding
        self.wrong = mx.zeros((embedding.weight.shape[0],), dtype=mx.bool_)
        self.wrong[mx.array(tokens)] = True
        self.shift = len(tokens) + 7

    def __call__(self, ids: mx.array) -> mx.array:
        other = self.embedding((ids + self.shift) % self.embedding.weight.shape[0]) * 4
        return mx.where(self.wrong[ids][..., None], other, self.embedding(ids))

    def as_linear(self, x: mx.array) -> mx.array:
        return self.embedding.as_linear(x)


def test_gate_fails_a_model_good_on_average_and_bad_on_one_domain(tiny):
    """Tokens that occur in the code windows and nowhere else are embedded wrongly: the model is
    exact on prose, chat and technical text and wrong on code. A threshold between the pooled KL
    and the code KL passes the pooled comparison and fails the domain gate, naming code."""
    path, tokenizer = tiny
    reference = load_model(path)[0]
    model = load_model(path)[0]
    by_domain = ev.domain_windows(tokenizer, windows=2, window_tokens=64)
    elsewhere = {t for d, ws in by_domain.items() if d != "code" for w in ws for t in w}
    code_only = sorted({t for w in by_domain["code"] for t in w} - elsewhere)
    assert code_only, "the code windows hold no token of their own"
    model.model.embed_tokens = _WrongOnSomeTokens(model.model.embed_tokens, code_only)

    results = ev.compare_domains(model, reference, by_domain)
    kl = {d: r["kl_mean"] for d, r in results["domains"].items()}
    assert max(kl, key=kl.get) == "code" and results["worst"]["domain"] == "code"
    assert max(kl[d] for d in kl if d != "code") < 1e-6 and results["kl_mean"] < kl["code"]
    limits = {"max_kl": (results["kl_mean"] + kl["code"]) / 2, "min_top1": 0.0}

    pooled_only = {k: v for k, v in results.items() if k not in ("domains", "worst")}
    assert ev.gate(pooled_only, 4, limits)["passed"]  # the average alone would pass it
    verdict = ev.gate(results, 4, limits)
    assert not verdict["passed"] and verdict["judged"] == "worst domain"
    assert len(verdict["failures"]) == 1 and "on code" in verdict["failures"][0]
    assert "every domain" in ev.verdict_line(verdict)
