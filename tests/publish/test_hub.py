"""mlxspec.publish.hub and `mlxspec upload`, end to end against the loopback Hub of tests/hub_server.py:
the real huggingface_hub client uploads through HF_ENDPOINT, and mlxspec.load downloads back."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import yaml
from click.testing import CliRunner
from hub_server import TOKENS, HubServer
from tiny_models import make_tiny_model, quantized_copy

from mlxspec import evaluation as ev
from mlxspec.cli.main import cli
from mlxspec.errors import EvaluationError, HubError
from mlxspec.evaluation import evaluate_saved
from mlxspec.publish import card, hub

TOKEN = next(t for t, user in TOKENS.items() if user == "me")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """An unquantized tiny model, its 8-bit quantization with passing results and its 4-bit
    quantization judged against an impossible gate (failing results)."""

    root = tmp_path_factory.mktemp("hub_models")
    source = make_tiny_model(root / "source")
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n# a source model\n")
    q8 = quantized_copy(source, root / "q8", bits=8)
    q4 = quantized_copy(source, root / "q4", bits=4)
    for path, thresholds in ((q8, None), (q4, {"max_kl": 0.0, "min_top1": 100.0})):
        evaluate_saved(path, reference=str(source), thresholds=thresholds, windows=2,
                       window_tokens=64, progress=False)
    return {"source": source, "q8": q8, "q4": q4}


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """A running loopback Hub, HF_ENDPOINT/HF_TOKEN/HF_HOME pointing at it and at a fresh cache."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    with HubServer(tmp_path / "hub") as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def _snapshot(path: Path) -> dict[str, str]:
    """Every file under ``path`` and its sha256: proves a directory was left untouched."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def _card(server: HubServer, repo: str) -> tuple[dict, str]:
    text = server.file_bytes(repo, "README.md").decode()
    assert text.startswith("---\n")
    meta, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(meta), body


def test_upload_sends_the_files_byte_identical_with_a_parsable_card(models, hub_env):
    url = hub.upload(models["q8"], "me/tiny-q8")
    assert url.endswith("/me/tiny-q8")
    local = {p.name for p in hub.upload_files(models["q8"])}
    assert {"config.json", "model.safetensors", "tokenizer.json", ev.EVAL_FILE} <= local
    assert hub_env.file_names("me/tiny-q8") == sorted(local | {"README.md"})
    for name in local:
        assert hub_env.file_bytes("me/tiny-q8", name) == (models["q8"] / name).read_bytes()
    meta, body = _card(hub_env, "me/tiny-q8")
    assert meta["library_name"] == "mlx" and meta["pipeline_tag"] == "text-generation"
    assert {"mlx", "mlxspec"} <= set(meta["tags"])
    assert meta["license"] == "apache-2.0"  # carried from the source model's card
    results = json.loads((models["q8"] / ev.EVAL_FILE).read_text())["results"]
    assert f"| mean KL divergence (nats/token) | {results['kl_mean']:.5f} |" in body
    assert f"{results['top1_agreement']:.2f}%" in body
    assert "| bits | 8 |" in body and "| group size | 32 |" in body
    assert "Quality gate: **PASS" in body and "--force" not in body
    assert "mlx_lm.generate --model me/tiny-q8" in body  # mlx-lm affine: plain mlx-lm loads it
    assert "| loads in | MLX affine layout" in body
    # the token went only into the Authorization header
    assert all(auth in (None, f"Bearer {TOKEN}") for _, _, auth in hub_env.requests)


def test_upload_through_the_lfs_batch_path(models, hub_env, monkeypatch):
    # Files of 4 KiB and more go through LFS batch + PUT + verify (Xet disabled, as the
    # loopback Hub does not speak it); the rest travel inside the commit.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    hub_env.lfs_threshold = 4096
    hub.upload(models["source"], "me/tiny")
    assert any(path.startswith("/lfs-upload/") for _, path, _ in hub_env.requests)
    for p in hub.upload_files(models["source"]):
        assert hub_env.file_bytes("me/tiny", p.name) == p.read_bytes()
    assert hub_env.repos["me/tiny"].files("main")[1]["model.safetensors"].lfs


def test_quantized_model_without_passing_results_is_refused_unless_forced(
    models, hub_env, tmp_path
):
    before = _snapshot(models["q4"])
    with pytest.raises(EvaluationError, match="failed the 4-bit quality gate.*--force"):
        hub.upload(models["q4"], "me/tiny-q4")
    assert "me/tiny-q4" not in hub_env.repos  # refused before anything was sent
    unevaluated = tmp_path / "q4-no-eval"
    unevaluated.mkdir()
    for p in models["q4"].iterdir():
        if p.name != ev.EVAL_FILE:
            (unevaluated / p.name).write_bytes(p.read_bytes())
    with pytest.raises(EvaluationError, match="no evaluation results"):
        hub.upload(unevaluated, "me/tiny-q4")

    hub.upload(models["q4"], "me/tiny-q4", force=True)
    _, body = _card(hub_env, "me/tiny-q4")
    assert "uploaded with `--force`" in body and "Quality gate: **FAIL" in body
    assert _snapshot(models["q4"]) == before


@pytest.mark.parametrize(
    "failure", ["no token", "bad token", "no permission", "conflict", "network"]
)
def test_failed_uploads_give_one_line_and_leave_the_directory_alone(
    models, hub_env, monkeypatch, failure
):
    repo = "me/tiny-q8"
    if failure == "no token":
        monkeypatch.delenv("HF_TOKEN")
    elif failure == "bad token":
        monkeypatch.setenv("HF_TOKEN", "hf_not_a_valid_token")
    elif failure == "no permission":
        repo = "other/tiny-q8"
    elif failure == "conflict":
        hub_env.fail["commit"] = 409
    elif failure == "network":
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    before = _snapshot(models["q8"])
    with pytest.raises(HubError) as raised:
        hub.upload(models["q8"], repo)
    message = str(raised.value)
    assert "\n" not in message and os.environ.get("HF_TOKEN", "@@") not in message
    expected = {
        "no token": "no Hugging Face token",
        "bad token": "rejected the token",
        "no permission": "no permission",
        "conflict": "conflict",
        "network": "unreachable",
    }[failure]
    assert expected in message
    assert _snapshot(models["q8"]) == before


def test_cli_upload_prints_one_line_errors_without_the_token(models, hub_env, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_but_wrong")
    result = CliRunner().invoke(cli, ["upload", str(models["q8"]), "me/x"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert result.stdout.startswith("uploading to me/x")  # the file list comes first
    assert "hf_secret_but_wrong" not in result.output
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    result = CliRunner().invoke(cli, ["upload", str(models["q8"]), "me/x", "--private"])
    assert result.exit_code == 0, result.output
    assert hub_env.repos["me/x"].private


def test_card_recommends_a_draft_and_names_the_base_model(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["quantization"] = {
        "bits": 4,
        "group_size": 64,
        "format": "zp",
        "method": "gptq",
        "source_model": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    }
    (model / "config.json").write_text(json.dumps(config))
    meta, body = card.model_card(model, "me/smollm2-1.7b-q4").split("---\n", 2)[1:]
    meta = yaml.safe_load(meta)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-1.7B-Instruct"
    assert meta["base_model_relation"] == "quantized"
    assert "--draft-model HuggingFaceTB/SmolLM2-135M-Instruct" in body
    assert "| method | gptq |" in body and "| format | mlxspec zero-point `zp`" in body
    assert "Plain mlx-lm cannot load these weights: mlxspec zero-point format" in body
    assert "## Use with mlx-lm" not in body and meta.get("library_name") is None
    assert "| loads in | mlxspec zero-point format" in body
    assert "No evaluation results" in body


def test_card_names_the_blocks_awq_gptq_left_unscaled(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["quantization"] = {"bits": 4, "group_size": 64, "format": "zp", "method": "awq+gptq",
                              "awq_unscaled_blocks": ["model.layers.0", "model.layers.1"]}
    (model / "config.json").write_text(json.dumps(config))
    body = card.model_card(model, "me/tiny-q4").split("---\n", 2)[2]
    assert ("| method | awq+gptq (plain GPTQ where AWQ's scales could not be folded: "
            "model.layers.0, model.layers.1) |") in body


def test_card_says_the_scales_were_distilled_and_whether_it_was_kept(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    for kept, tail in ((True, ")"), (False, "; not kept: it was worse)")):
        config["quantization"] = {"bits": 4, "group_size": 64, "format": "mlx", "method": "gptq",
                                  "distillation": {"epochs": 8, "kl_before": 0.25,
                                                   "kl_after": 0.2 if kept else 0.3,
                                                   "kept": kept}}
        (model / "config.json").write_text(json.dumps(config))
        body = card.model_card(model, "me/tiny-q4").split("---\n", 2)[2]
        after = 0.2 if kept else 0.3
        assert (f"| method | gptq, then scales distilled from the source (8 epochs, held-out KL "
                f"0.25 -> {after}{tail} |") in body


def test_quantize_gate_refuses_a_failing_model_and_keeps_its_results(models, hub_env, tmp_path):
    out = tmp_path / "q4-fail"
    result = CliRunner().invoke(cli, [
        "quantize", str(models["source"]), "--out", str(out), "--bits", "4", "--method", "rtn",
        "--max-kl", "0", "--min-top1", "100", "--upload-repo", "me/fail",
    ])
    assert result.exit_code == 2
    assert "quality gate: FAIL" in result.output and "refusing to upload" in result.output
    assert ev.read_results(out)["verdict"]["passed"] is False
    assert "me/fail" not in hub_env.repos


def test_quantize_upload_download_round_trip(models, hub_env, tmp_path):
    """`mlxspec quantize --upload-repo` gates and uploads; then `mlxspec.load("me/repo")` and
    `mlxspec chat` in fresh processes (HF_ENDPOINT read at import, fresh HF_HOME) get
    byte-identical files and the same model outputs."""
    out = tmp_path / "q4"
    result = CliRunner().invoke(cli, [
        "quantize", str(models["source"]), "--out", str(out), "--bits", "4", "--method", "gptq",
        "--calibration-windows", "4", "--calibration-tokens", "64", "--upload-repo", "me/tiny-q4",
    ])
    assert result.exit_code == 0, result.output
    assert "quality gate: PASS" in result.output and "uploaded" in result.output
    _, body = _card(hub_env, "me/tiny-q4")
    # The default format is MLX's exact affine layout: the card says plain mlx-lm loads it.
    assert "| method | gptq |" in body and "| format | mlx-lm affine" in body
    assert "## Use with mlx-lm" in body
    assert "Quality gate: **PASS" in body

    script = (
        "import sys, mlxspec, mlx.core as mx\n"
        "from mlxspec.load import resolve_model_path\n"
        "model, tok = mlxspec.load('me/tiny-q4')\n"
        "print(resolve_model_path('me/tiny-q4'))\n"
        "print(mx.argmax(model(mx.array([[1, 2, 3, 4]]))[0], axis=-1).tolist())\n"
    )
    env = dict(os.environ)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    snapshot, argmax = run.stdout.strip().splitlines()[-2:]
    snapshot = Path(snapshot)
    assert str(snapshot).startswith(os.environ["HF_HOME"])
    for p in hub.upload_files(out):
        assert (snapshot / p.name).read_bytes() == p.read_bytes()

    import mlx.core as mx

    from mlxspec.load import load

    local, _ = load(out)
    assert json.loads(argmax) == mx.argmax(local(mx.array([[1, 2, 3, 4]]))[0], axis=-1).tolist()

    chat = subprocess.run(
        [sys.executable, "-m", "mlxspec.cli.main", "chat", "--model", "me/tiny-q4",
         "--max-tokens", "8"],
        input="hello\n/quit\n", env=env, capture_output=True, text=True, timeout=300,
    )
    assert chat.returncode == 0, chat.stderr[-2000:]
