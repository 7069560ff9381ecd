"""mlxspec.evaluation and `mlxspec eval`: checked against float64 numpy on tiny random models, real
mlx-lm quantizations of them, and the shipped evaluation text."""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from importlib.resources import files
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.utils import load_model, load_tokenizer
from tiny_models import make_tiny_model, perturbed_copy, quantized_copy

from mlxspec import evaluation as ev
from mlxspec.cli.main import cli
from mlxspec.errors import EvaluationError
from mlxspec.evaluation import windows as windows_module


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_models")
    source = make_tiny_model(root / "source")
    return {
        "source": source,
        "near": perturbed_copy(source, root / "near", noise=0.02),
        "far": perturbed_copy(source, root / "far", noise=0.3),
        "q4": quantized_copy(source, root / "q4", bits=4),
        "q8": quantized_copy(source, root / "q8", bits=8),
    }


def _load(path):
    return load_model(Path(path))[0]


@pytest.fixture(scope="module")
def tokenizer(models):
    return load_tokenizer(models["source"])


@pytest.fixture(scope="module")
def windows(tokenizer):
    return ev.builtin_windows(tokenizer, windows=4, window_tokens=96)


def _np_log_probs(model, window) -> np.ndarray:
    logits = model(mx.array(window[:-1])[None])[0]
    x = np.array(logits.astype(mx.float32), dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_compare_matches_float64_numpy(models, windows):
    model, reference = _load(models["far"]), _load(models["source"])
    kl, agree, nll, ref_nll = [], [], [], []
    for w in windows:
        logq, logp = _np_log_probs(model, w), _np_log_probs(reference, w)
        kl.append((np.exp(logp) * (logp - logq)).sum(-1))
        agree.append(logp.argmax(-1) == logq.argmax(-1))
        idx = np.arange(len(w) - 1)
        nll.append(-logq[idx, w[1:]])
        ref_nll.append(-logp[idx, w[1:]])
    kl, agree = np.concatenate(kl), np.concatenate(agree)
    nll, ref_nll = np.concatenate(nll), np.concatenate(ref_nll)

    got = ev.compare(model, reference, windows)

    assert got["tokens"] == kl.size == 4 * 95 and got["windows"] == 4
    assert got["kl_mean"] == pytest.approx(kl.mean(), rel=1e-3, abs=1e-6)
    assert got["kl_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-3, abs=1e-6)
    assert got["top1_agreement"] == pytest.approx(100 * agree.mean())
    assert got["perplexity"] == pytest.approx(np.exp(nll.mean()), rel=1e-4)
    assert got["reference_perplexity"] == pytest.approx(np.exp(ref_nll.mean()), rel=1e-4)
    se = np.exp(nll.mean()) * nll.std(ddof=1) / np.sqrt(nll.size)
    assert got["perplexity_se"] == pytest.approx(se, rel=1e-3)
    assert got["perplexity_delta"] == pytest.approx(got["perplexity"] - got["reference_perplexity"])


def test_model_against_itself_has_zero_kl_and_full_agreement(models, windows):
    model = _load(models["source"])
    got = ev.compare(model, model, windows)
    assert got["kl_mean"] == 0.0 and got["kl_p99"] == 0.0
    assert got["top1_agreement"] == 100.0 and got["perplexity_delta"] == 0.0


def test_divergence_grows_with_the_distance_from_the_reference(models, windows):
    reference = _load(models["source"])
    near = ev.compare(_load(models["near"]), reference, windows)
    far = ev.compare(_load(models["far"]), reference, windows)
    q8 = ev.compare(_load(models["q8"]), reference, windows)
    q4 = ev.compare(_load(models["q4"]), reference, windows)
    assert 0 < near["kl_mean"] < far["kl_mean"]
    assert near["top1_agreement"] >= far["top1_agreement"]
    assert 0 < q8["kl_mean"] < q4["kl_mean"]


def test_perplexity_matches_compare(models, windows):
    model, reference = _load(models["q4"]), _load(models["source"])
    alone = ev.perplexity(model, windows)
    both = ev.compare(model, reference, windows)
    assert alone["perplexity"] == pytest.approx(both["perplexity"], rel=1e-6)
    assert alone["tokens"] == both["tokens"]


def test_acceptance_matches_float64_numpy(models, windows):
    target, draft = _load(models["source"]), _load(models["far"])
    got = ev.acceptance(target, draft, windows)
    for temp in (0.0, 0.7, 1.0):
        rates = []
        for w in windows:
            logp, logq = _np_log_probs(target, w), _np_log_probs(draft, w)
            if temp == 0:
                rates.append(logp.argmax(-1) == logq.argmax(-1))
            else:
                p = np.exp(logp / temp)
                q = np.exp(logq / temp)
                p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
                rates.append(np.minimum(p, q).sum(-1))
        alpha = np.concatenate(rates).mean()
        row = got["temperatures"][f"{temp:g}"]
        assert row["alpha"] == pytest.approx(alpha, rel=1e-4)
        for k in range(1, 9):
            expected = sum(alpha**i for i in range(k + 1))
            assert row["tokens_per_pass"][str(k)] == pytest.approx(expected, rel=1e-4)


def test_a_model_drafting_for_itself_is_always_accepted(models, windows):
    model = _load(models["source"])
    got = ev.acceptance(model, model, windows)
    for row in got["temperatures"].values():
        assert row["alpha"] == pytest.approx(1.0, abs=1e-5)
        assert row["tokens_per_pass"]["8"] == pytest.approx(9.0, rel=1e-4)


def test_tokens_per_pass_is_the_geometric_series():
    assert ev.tokens_per_pass(0.0, 5) == 1.0
    assert ev.tokens_per_pass(1.0, 4) == 5.0
    assert ev.tokens_per_pass(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_gate_defaults_overrides_and_failures():
    good = {"kl_mean": 0.005, "top1_agreement": 98.0}
    assert ev.gate(good, 8)["passed"]
    bad = ev.gate({"kl_mean": 0.05, "top1_agreement": 90.0}, 8)
    assert not bad["passed"] and len(bad["failures"]) == 2
    assert ev.gate({"kl_mean": 0.05, "top1_agreement": 90.0}, 4)["passed"]
    assert not ev.gate({"kl_mean": 0.2, "top1_agreement": 90.0}, 4)["passed"]
    # 3 bits is held to the 4-bit bar unless the user overrides it
    assert ev.gate({"kl_mean": 0.2, "top1_agreement": 90.0}, 3)["max_kl"] == 0.10
    assert ev.gate({"kl_mean": 0.2, "top1_agreement": 90.0}, 3, {"max_kl": 0.3})["passed"]
    assert ev.gate(good, 8, {"max_kl": None, "min_top1": 99.0})["failures"] == [
        "top-1 agreement 98.00% < 99%"
    ]
    assert ev.verdict_line(ev.gate(good, 8)).startswith("PASS")


def test_builtin_text_matches_its_recorded_provenance():
    data = files("mlxspec") / "data"
    text = (data / "eval.txt").read_bytes()
    provenance = (data / "PROVENANCE.md").read_text()
    section = provenance.split("## eval.txt", 1)[1].split("\n## ", 1)[0]
    recorded = re.findall(r"sha256\s+`([0-9a-f]{64})`", section.replace("\n", " "))
    assert hashlib.sha256(text).hexdigest() in recorded
    assert 20_000 < len(text) < 200_000


def test_builtin_windows_are_consecutive_pieces_of_the_text(tokenizer):
    windows = ev.builtin_windows(tokenizer, windows=3, window_tokens=50)
    assert [len(w) for w in windows] == [50, 50, 50]
    joined = tokenizer.decode([t for w in windows for t in w])
    assert ev.builtin_text().startswith(joined)
    everything = ev.builtin_windows(tokenizer, windows=None, window_tokens=1000)
    assert len(everything) == len(ev.builtin_text().encode()) // 1000  # one token per byte
    with pytest.raises(EvaluationError, match="holds"):
        ev.builtin_windows(tokenizer, windows=10_000, window_tokens=1000)


def test_text_windows_stream_in_chunks_without_changing_tokens(tokenizer, tmp_path, monkeypatch):
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
    path = tmp_path / "long.txt"
    path.write_text(text)
    monkeypatch.setattr(windows_module, "CHUNK_CHARS", 100)  # many chunks, each cut inside a line
    streamed = list(ev.text_windows(tokenizer, path, window_tokens=64))
    whole = tokenizer.encode(text, add_special_tokens=False)
    assert streamed == [whole[i : i + 64] for i in range(0, len(whole) - 63, 64)]
    assert ev.take_windows(tokenizer, path, 3, 64) == streamed[:3]
    with pytest.raises(EvaluationError, match="fewer than"):
        ev.take_windows(tokenizer, path, 10_000, 64)


def test_cli_eval_defaults_to_the_recorded_source_model(models):
    result = CliRunner().invoke(cli, ["eval", str(models["q4"]), "-n", "2", "-t", "64", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["reference"] == str(models["source"])
    # the built-in held-out text by domain: 2 windows each, pooled and per domain
    assert set(data["domains"]) == {"prose", "code", "chat", "technical"}
    assert all(d["tokens"] == 2 * 63 for d in data["domains"].values())
    assert data["tokens"] == 4 * 2 * 63 and data["kl_mean"] > 0
    assert 0 < data["top1_agreement"] <= 100
    worst = data["worst"]
    assert worst["kl_mean"] == max(d["kl_mean"] for d in data["domains"].values())
    assert worst == {"domain": worst["domain"], **data["domains"][worst["domain"]]}
    table = CliRunner().invoke(cli, ["eval", str(models["q4"]), "-n", "2", "-t", "64"]).output
    assert f"worst: {worst['domain']}" in table and "technical" in table


def test_cli_eval_without_reference_reports_perplexity(models):
    result = CliRunner().invoke(cli, ["eval", str(models["source"]), "-n", "2", "-t", "64"])
    assert result.exit_code == 0, result.output
    assert "perplexity" in result.output and "no reference" in result.output


def test_cli_eval_draft_mode_prints_acceptance_per_temperature(models, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(ev.builtin_text()[:5000])
    result = CliRunner().invoke(
        cli,
        [
            "eval",
            str(models["source"]),
            "--draft",
            str(models["q4"]),
            "--text",
            str(text),
            "-n",
            "2",
            "-t",
            "64",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert set(data["temperatures"]) == {"0", "0.7", "1"}
    assert set(data["temperatures"]["0.7"]["tokens_per_pass"]) == {str(k) for k in range(1, 9)}


def test_cli_eval_user_errors_are_one_line(models, tmp_path):
    runner = CliRunner()
    result = runner.invoke(
        cli, ["eval", str(models["source"]), "--text", str(tmp_path / "x.txt"), "--builtin"]
    )
    assert result.exit_code == 2 and "exclude each other" in result.output
    result = runner.invoke(cli, ["eval", str(models["source"]), "-n", "100000"])
    assert result.exit_code == 2 and result.output.count("\n") == 1


def test_cli_eval_save_stores_the_gate_verdict(models, tmp_path):
    q4 = tmp_path / "q4"
    q4.mkdir()
    for p in models["q4"].iterdir():
        (q4 / p.name).write_bytes(p.read_bytes())
    result = CliRunner().invoke(
        cli,
        ["eval", str(q4), "--save", "-n", "2", "-t", "64", "--max-kl", "0", "--min-top1", "100"],
    )
    assert result.exit_code == 0, result.output
    assert "FAIL (4-bit gate: KL <= 0, top-1 >= 100% on every domain)" in result.output
    record = ev.read_results(q4)
    assert record["verdict"]["passed"] is False and record["reference"] == str(models["source"])
    assert record["results"]["tokens"] == 4 * 2 * 63
    assert record["verdict"]["judged"] == "worst domain"
    assert any("on code" in f for f in record["verdict"]["failures"])
    result = CliRunner().invoke(cli, ["eval", str(models["source"]), "--save"])
    assert result.exit_code == 2 and "not a quantized model" in result.output


def test_dense_cpu_copy_computes_what_the_quantized_layers_compute(models):
    quantized = _load(models["q4"])
    dense = ev.dense_on_cpu(_load(models["q4"]))
    if not mx.metal.is_available():
        assert not any(isinstance(m, nn.QuantizedLinear) for _, m in dense.named_modules())
    x = mx.array([[5, 17, 99, 3, 250, 42]])
    want = np.array(quantized(x), dtype=np.float64)
    got = np.array(dense(x), dtype=np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.slow
def test_smollm2_8bit_evaluates_the_same_in_both_formats_and_stays_close(smollm2_dir,
                                                                         smollm2_q8_dirs):
    """The real tokenizer and model: one 8-bit quantization of SmolLM2-135M saved as mlxspec
    zero-point and as mlx-lm affine (QuantizedLinear, de-quantized on the CPU) diverges from the
    float32 source by little, by the same amount in both formats, on real text windows."""
    got = {fmt: ev.evaluate(path, windows=1, window_tokens=128)
           for fmt, path in smollm2_q8_dirs.items()}
    zp, mlx = got["zp"], got["mlx"]
    assert zp["reference"] == mlx["reference"] == str(smollm2_dir)  # the recorded source
    assert 0 < zp["kl_mean"] < 0.01 and zp["top1_agreement"] > 90, zp
    # the same weights up to the storage of scales and offsets: the same KL to 1e-4 nats
    assert mlx["kl_mean"] == pytest.approx(zp["kl_mean"], abs=1e-4)
    assert mlx["top1_agreement"] == pytest.approx(zp["top1_agreement"], abs=1.0)
    assert 10 < zp["reference_perplexity"] < 200


def test_builtin_windows_are_real_text_for_a_real_tokenizer(smollm2):
    _, tokenizer = smollm2
    windows = ev.builtin_windows(tokenizer, windows=1, window_tokens=128)
    assert tokenizer.decode(windows[0]).startswith("Chapter 1\n\nSir Walter Elliot")


def test_eval_text_shares_no_passage_with_the_calibration_text():
    data = files("mlxspec") / "data"
    calibration = data / "calibration.txt"
    if not calibration.is_file():
        pytest.skip("no built-in calibration text in this checkout")

    def shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
        words = text.split()
        return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}

    assert not shingles(ev.builtin_text()) & shingles(calibration.read_text(encoding="utf-8"))


def test_models_with_different_tokenizers_are_refused(tokenizer, smollm2):
    from mlxspec.errors import TokenizerMismatchError

    with pytest.raises(TokenizerMismatchError, match="the draft model"):
        ev.check_same_tokenizer(tokenizer, smollm2[1], "the draft model")
    ev.check_same_tokenizer(smollm2[1], smollm2[1])


def test_evaluate_refuses_to_compare_a_model_with_itself(models):
    with pytest.raises(EvaluationError, match="itself"):
        ev.evaluate(models["q4"], reference=models["q4"])
    result = CliRunner().invoke(cli, ["eval", str(models["q4"]), "--save", "-r",
                                      str(models["q4"])])
    assert result.exit_code == 2 and "itself" in result.output
    assert ev.read_results(models["q4"]) is None  # nothing was stored


def test_evaluate_is_the_api_of_the_cli(models):
    """The library call and the command give the same numbers (the CLI only renders)."""
    api = ev.evaluate(models["q4"], windows=2, window_tokens=64)
    cli_result = CliRunner().invoke(cli, ["eval", str(models["q4"]), "-n", "2", "-t", "64",
                                          "--json"])
    assert json.loads(cli_result.output) == json.loads(json.dumps(api))
    assert api["reference"] == str(models["source"]) and api["kl_mean"] > 0


def test_cli_defaults_are_the_library_defaults():
    params = {p.name: p.default for p in cli.get_command(None, "eval").params}
    assert params["windows"] is None  # per domain of the built-in text, or of a --text file
    assert inspect.signature(ev.evaluate).parameters["windows"].default is None
    assert params["window_tokens"] == ev.DEFAULT_WINDOW_TOKENS
