"""The command line as a user meets it: bad input and help in-process (click's CliRunner), and a
handful of true end-to-end runs of the installed command: a subprocess, a pipe, a terminal."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlxspec.cli.main import cli
from mlxspec.cpu import jit as cpu_jit

MLXSPEC = str(Path(sys.executable).parent / "mlxspec")


def run(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [MLXSPEC, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ.copy(),
    )


def invoke(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run `mlxspec ARGS` in this process; the result reads like a subprocess's."""
    result = CliRunner().invoke(cli, list(args), input=stdin)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_generate_json_on_the_default_model(smollm2_dir):
    result = invoke(
        "generate", "--prompt", "What is the capital of France?", "--max-tokens", "16", "--json"
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert "Paris" in out["text"]
    assert 0 < out["generation_tokens"] <= 16 and out["generation_tps"] > 0
    # the weights read per token: the GGUF's packed blocks (~99 MB) or their float32 copy
    # (~538 MB), as this machine imports GGUF files (mlxspec.gguf.tensors.import_mode)
    from mlxspec.gguf.tensors import import_mode

    packed = import_mode() == "quantized"
    assert (90e6 < out["model_bytes"] < 110e6) if packed else (500e6 < out["model_bytes"] < 560e6)


def test_generate_streams_text_then_a_stats_line(smollm2_dir):
    result = run("generate", "-p", "Say hello.", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "generation:" in result.stderr and "tok/s" in result.stderr


def test_chat_from_a_pipe_answers_each_turn_and_reuses_the_cache(smollm2_dir):
    result = run(
        "chat", "--max-tokens", "16", stdin="My name is Ada.\nWhat is my name?\n/stats\n/quit\n"
    )
    assert result.returncode == 0, result.stderr
    replies = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(replies) >= 3, result.stdout  # two replies and the stats line
    stats = next(line for line in replies if "prefilled this turn" in line)
    prefilled = int(stats.split("prefilled this turn: ")[1].split()[0])
    prompt_tokens = int(stats.split("prompt: ")[1].split()[0])
    assert prefilled == prompt_tokens < 30  # the second turn prefilled only its own tokens


@pytest.mark.parametrize(
    "args, needles",
    [
        (["generate", "--model", "./does/not/exist"], ["model not found"]),
        (["generate", "--model", "missing.gguf"], ["GGUF file not found"]),
        (["generate", "--model", "not-a-repo-id"], ["model not found"]),
    ],
)
def test_user_mistakes_give_one_line_and_exit_2(args, needles):
    assert_one_line_error(invoke(*args), *needles)


def test_corrupt_model_directory_gives_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"junk")
    assert_one_line_error(invoke("generate", "--model", str(tmp_path)), "not valid JSON")


def test_bad_option_values_exit_2_without_traceback():
    for args in (
        ["generate", "--temp", "-1"],
        ["generate", "--num-draft-tokens", "zero"],
        ["chat", "--max-tokens", "0"],
    ):
        result = invoke(*args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, args


def test_debug_flag_shows_the_traceback():
    result = invoke("--debug", "generate", "--model", "./does/not/exist")
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_every_command_has_help_with_examples():
    from mlxspec.cli.main import COMMANDS

    for name in COMMANDS:
        result = invoke(name, "--help")
        assert result.returncode == 0 and "Example" in result.stdout, name


@pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)"
)
def test_chat_in_a_terminal_with_ctrl_c_and_ctrl_d(smollm2_dir, tmp_path):
    """Drive `mlxspec chat` in tmux as a person would: type, interrupt a reply, type again, exit."""
    session = f"mlxspec-test-{os.getpid()}"
    env = {"MLXSPEC_HOME": os.environ["MLXSPEC_HOME"]}
    exports = " ".join(f"{k}={v}" for k, v in env.items())

    def tmux(*args):
        return subprocess.run(["tmux", *args], capture_output=True, text=True, check=False)

    def screen() -> str:
        return tmux("capture-pane", "-p", "-S", "-200", "-t", session).stdout

    def wait_for(predicate, timeout=180):
        end = time.time() + timeout
        while time.time() < end:
            if predicate(screen()):
                return True
            time.sleep(0.5)
        return False

    tmux(
        "new-session",
        "-d",
        "-s",
        session,
        "-x",
        "200",
        "-y",
        "50",
        f"{exports} {MLXSPEC} chat --max-tokens 200; echo EXITED-$?; sleep 30",
    )
    try:
        # capture-pane drops trailing blanks, so the prompt ">> " shows as ">>"
        assert wait_for(lambda s: s.rstrip().endswith(">>")), screen()
        tmux("send-keys", "-t", session, "Write a long poem about the ocean.", "Enter")
        assert wait_for(lambda s: len(s.split(">> ")[-1].strip()) > 60), screen()
        tmux("send-keys", "-t", session, "C-c")
        assert wait_for(lambda s: "[interrupted]" in s), screen()
        assert wait_for(lambda s: s.rstrip().endswith(">>")), screen()
        tmux("send-keys", "-t", session, "/help", "Enter")
        assert wait_for(lambda s: "/reset" in s), screen()
        tmux("send-keys", "-t", session, "C-d")
        assert wait_for(lambda s: "EXITED-0" in s), screen()
    finally:
        tmux("kill-session", "-t", session)


def test_doctor_reports_the_blas_and_the_quantized_paths(smollm2_dir):
    result = invoke("doctor", "--no-measure", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    if sys.platform != "linux":
        pytest.skip("the BLAS and fallback lines checked below are the Linux CPU build's")
    assert report["metal_available"] is False
    assert "MLX fallback" in report["quantized_matmul"] and "Metal is not available" in (
        report["quantized_matmul"])
    assert report["zero_point_layers"].startswith("zero-point layers on CPU")
    assert "openblas" in json.dumps(report["blas"]).lower()
    assert report["default_model"] == str(smollm2_dir) or Path(report["default_model"]).exists()
    # The BLAS is chosen before mlx.core loads: another process shows the other choice.
    with_reference = subprocess.run([MLXSPEC, "doctor", "--no-measure"], capture_output=True,
                                    text=True, env={**os.environ, "MLXSPEC_BLAS": "reference"})
    assert with_reference.returncode == 0 and "reference" in with_reference.stdout.lower()


def test_system_report_is_the_library_side_of_doctor():
    from mlxspec import system_report

    report = system_report(measure=False)
    assert report["mlxspec"] and report["blas"]["active"] in (
        "openblas", "custom", "preloaded", "reference", "accelerate")
    assert "matmul_gflops" not in report["blas"]
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in
             (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    if names:  # the CPU named as Linux names it (benchmark results record it)
        assert report["cpu"].startswith(names[0]) and "family" in report["cpu"]
    assert report["cpu"]
    if platform.system() == "Linux":  # the Linux CPU backend (a Mac reports it unused)
        assert report["fused_ops"].startswith("compiled")
    if cpu_jit._cpu_supported() and shutil.which("g++"):
        assert report["cpu_jit"].startswith("g++ -mavx2")
