"""`mlxspec quantize` as a user runs it: real subprocesses, the saved directory, its reloading by
mlxspec and by plain mlx-lm, and one-line errors for bad input."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import make_tiny_model

from mlxspec.quant import layers
from mlxspec.quant.quantize import builtin_calibration_path

MLXSPEC = str(Path(sys.executable).parent / "mlxspec")


def quantize(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run `mlxspec quantize ARGS --no-eval` (the quality gate is tested with mlxspec.eval)."""
    return subprocess.run([MLXSPEC, "quantize", *args, "--no-eval"], capture_output=True,
                          text=True, timeout=timeout, env=os.environ.copy())


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny_quantized(tiny_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q") / "tiny-q4"
    result = quantize(str(tiny_dir), "--out", str(out), "--group-size", "32",
                      "--calibration-windows", "4", "--calibration-tokens", "64")
    assert result.returncode == 0, result.stderr
    assert "bits per weight" in result.stdout
    return out


def test_quantize_writes_a_complete_directory_that_mlxspec_loads(tiny_dir, tiny_quantized):
    from mlxspec.load import load

    names = {p.name for p in tiny_quantized.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [p for p in tiny_quantized.parent.iterdir() if p.name.startswith(".")]
    record = json.loads((tiny_quantized / "config.json").read_text())["quantization"]
    assert record["format"] == "zp" and record["method"] == "gptq"
    assert record["bits"] == 4 and record["group_size"] == 32
    assert record["mlxspec_version"]
    assert record["source_model"] == str(tiny_dir.resolve())
    builtin = hashlib.sha256(builtin_calibration_path().read_bytes()).hexdigest()
    assert record["calibration_sha256"] == builtin
    model, tokenizer = load(str(tiny_quantized))
    assert layers.zero_point_modules(model)
    assert tokenizer.chat_template
    out = model(mx.array([[1, 2, 3]]))
    assert out.shape == (1, 3, 260) and bool(mx.all(mx.isfinite(out)))


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--bits", "5"], ["unsupported bits=5"]),
        (["--group-size", "48"], ["unsupported group size 48"]),
        (["--group-size", "128"], ["group size 128 does not divide in_features=64",
                                   "--group-fallback"]),
        (["--act-order", "--format", "mlx"], ["--act-order needs --format zp"]),
        (["--calibration", "/no/such/file.txt"], ["calibration text not found"]),
        (["--mixed", "no-such-recipe"], ["no recipe 'no-such-recipe'", "embed8"]),
    ],
)
def test_bad_values_give_one_line_and_exit_2(tiny_dir, tmp_path, extra, needles):
    result = quantize(str(tiny_dir), "--out", str(tmp_path / "out"), *extra)
    assert_one_line_error(result, *needles)
    assert not (tmp_path / "out").exists()


def test_refuses_to_overwrite_without_force_and_to_requantize(tiny_dir, tiny_quantized,
                                                             tmp_path):
    assert_one_line_error(quantize(str(tiny_dir), "--out", str(tiny_quantized)),
                          "exists: pass --force")
    assert_one_line_error(quantize(str(tiny_quantized), "--out", str(tmp_path / "again")),
                          "already quantized")
    target = tmp_path / "forced"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    result = quantize(str(tiny_dir), "--out", str(target), "--force", "--method", "rtn",
                      "--bits", "8", "--group-size", "64")
    assert result.returncode == 0, result.stderr
    assert not (target / "stale.txt").exists()
    assert json.loads((target / "config.json").read_text())["quantization"]["bits"] == 8


def test_group_fallback_and_recipe_are_recorded(tiny_dir, tmp_path):
    out = tmp_path / "mixed"
    result = quantize(str(tiny_dir), "--out", str(out), "--method", "rtn", "--group-size", "128",
                      "--group-fallback", "--mixed", "embed8")
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "config.json").read_text())["quantization"]
    assert record["recipe"] == "embed8"
    assert record["layers"]["model.embed_tokens"] == {"bits": 8, "group_size": 64}
    assert record["layers"]["model.layers.0.self_attn.q_proj"] == {"bits": 4, "group_size": 64}
    assert "model.layers.0.mlp.down_proj" not in record["layers"]  # 128 wide: g128 fits


@pytest.mark.slow
def test_smollm2_zp_and_mlx_formats_give_the_same_logits(smollm2_dir, tmp_path, monkeypatch):
    from mlx_lm import load as mlx_lm_load

    from mlxspec.load import load

    zp_dir, mlx_dir = tmp_path / "zp", tmp_path / "mlx"
    for out, fmt in ((zp_dir, "zp"), (mlx_dir, "mlx")):
        result = quantize(str(smollm2_dir), "--out", str(out), "--method", "rtn", "--format", fmt,
                          "--mixed", "embed8")
        assert result.returncode == 0, result.stderr
    assert (zp_dir / "tokenizer.json").is_file()
    x = mx.array([[1, 504, 3300, 281, 1116, 30, 2, 198]])

    # The mlx format, through plain mlx-lm, computes exactly what the zp model computes on its
    # packed path (mx.quantized_matmul on the same affine form); the zp default CPU path (a
    # float32 copy and BLAS) agrees to float32 rounding.
    mlx_model, mlx_tokenizer = mlx_lm_load(str(mlx_dir))
    want = np.array(mlx_model(x))
    monkeypatch.setenv(layers.CPU_PATH_ENV, "quantized")
    packed, tokenizer = load(str(zp_dir))
    np.testing.assert_array_equal(np.array(packed(x)), want)
    monkeypatch.setenv(layers.CPU_PATH_ENV, "dense")
    dense, _ = load(str(zp_dir))
    np.testing.assert_allclose(np.array(dense(x)), want, rtol=1e-4, atol=1e-3)
    assert tokenizer.chat_template and mlx_tokenizer.chat_template
    zp_bytes = sum(f.stat().st_size for f in zp_dir.glob("*.safetensors"))
    mlx_bytes = sum(f.stat().st_size for f in mlx_dir.glob("*.safetensors"))
    assert zp_bytes < mlx_bytes < 0.35 * sum(
        f.stat().st_size for f in smollm2_dir.glob("*.safetensors")
    )


@pytest.mark.slow
def test_gemma3_awq_zp_directory_reloads_close_to_the_float_model(gemma3_gguf, gemma3, tmp_path):
    """Gemma-3 (``1 + w`` norms, sliding-window layers, 262k-token tied embedding) through the
    whole path: AWQ scales folded into its norms, 8-bit zp saved, reloaded by mlxspec.load."""
    from mlxspec.eval import builtin_windows, compare
    from mlxspec.load import load

    out = tmp_path / "gemma-awq8"
    result = quantize(str(gemma3_gguf), "--out", str(out), "--method", "awq", "--bits", "8",
                      "--calibration-windows", "4", "--calibration-tokens", "128")
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "config.json").read_text())["quantization"]
    assert record["method"] == "awq" and record["format"] == "zp" and record["bits"] == 8
    model, _ = load(str(out))
    assert layers.is_quantized(model)
    reference, tokenizer = gemma3
    quality = compare(model, reference, builtin_windows(tokenizer, windows=1, window_tokens=256))
    assert quality["kl_mean"] < 0.02 and quality["top1_agreement"] > 95, quality


def test_mixed_auto_measures_sensitivity_and_records_it(tiny_dir, tmp_path):
    out = tmp_path / "auto"
    result = quantize(str(tiny_dir), "--out", str(out), "--method", "rtn", "--group-size", "32",
                      "--mixed", "auto:5")
    assert result.returncode == 0, result.stderr
    assert "by measured sensitivity within 5 bits per weight" in result.stdout
    record = json.loads((out / "config.json").read_text())["quantization"]
    assert record["recipe"] == "sensitivity:5" and record["sensitivity"]
    assert {spec["bits"] for spec in record["layers"].values()} == {8}
    assert_one_line_error(quantize(str(tiny_dir), "--out", str(tmp_path / "x"), "--mixed",
                                   "auto:lots"), "give auto or auto:BPW")
