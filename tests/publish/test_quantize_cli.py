"""`mlxspec quantize` and ``quantize_to_dir``: the saved directory, its reloading by mlxspec and
by plain mlx-lm, one-line errors for bad input, and nothing lost on hostile output paths.

In-process (click's CliRunner) except one true subprocess run of the installed command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from tiny_models import make_tiny_model

from mlxspec.cli.main import cli
from mlxspec.quant import layers

MLXSPEC = str(Path(sys.executable).parent / "mlxspec")


class Result:
    """What a command run left: exit code, stdout, stderr (CliRunner keeps them apart)."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def quantize(*args: str, evaluate: bool = False) -> Result:
    """Run `mlxspec quantize ARGS` in this process (--no-eval unless ``evaluate``)."""
    extra = [] if evaluate else ["--no-eval"]
    result = CliRunner().invoke(cli, ["quantize", *args, *extra])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Result(result.exit_code, result.stdout, result.stderr)


def assert_one_line_error(result: Result, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes: to show that nothing changed."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny_quantized(tiny_dir, tmp_path_factory) -> Path:
    """The one true end-to-end run: the installed command in a subprocess, quality gate on."""
    out = tmp_path_factory.mktemp("q") / "tiny-q4"
    result = subprocess.run(
        [MLXSPEC, "quantize", str(tiny_dir), "--out", str(out), "--group-size", "32",
         "--format", "zp",
         "--calibration-windows", "4", "--calibration-tokens", "64", "--max-kl", "10",
         "--min-top1", "0"],
        capture_output=True, text=True, timeout=900, env=os.environ.copy(),
    )
    assert result.returncode == 0, result.stderr
    assert "bits per weight" in result.stdout and "quality gate: PASS" in result.stdout
    return out


def test_quantize_writes_a_complete_directory_that_mlxspec_loads(tiny_dir, tiny_quantized):
    from mlxspec.load import load

    names = {p.name for p in tiny_quantized.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [p for p in tiny_quantized.parent.iterdir() if p.name.startswith(".")]
    record = json.loads((tiny_quantized / "config.json").read_text())["quantization"]
    assert record["format"] == "zp" and record["method"] == "awq+gptq"  # the default
    assert record["bits"] == 4 and record["group_size"] == 32
    assert record["mlxspec_version"]
    assert record["source_model"] == str(tiny_dir.resolve())
    # the built-in multi-domain set with the model's own answers (mlxspec.quant.calibration_set)
    assert record["calibration"] == "builtin+self-generated"
    assert len(record["calibration_sha256"]) == 64 and int(record["calibration_sha256"], 16) >= 0
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
    target = tmp_path / "forced"  # a model directory mlxspec wrote, with a stale extra file
    target.mkdir()
    for p in tiny_quantized.iterdir():
        (target / p.name).write_bytes(p.read_bytes())
    (target / "stale.txt").write_text("old")
    result = quantize(str(tiny_dir), "--out", str(target), "--force", "--method", "rtn",
                      "--bits", "8", "--group-size", "64")
    assert result.returncode == 0, result.stderr
    assert not (target / "stale.txt").exists()
    assert json.loads((target / "config.json").read_text())["quantization"]["bits"] == 8


def test_group_fallback_and_recipe_are_recorded(tiny_dir, tmp_path):
    out = tmp_path / "mixed"
    result = quantize(str(tiny_dir), "--out", str(out), "--method", "rtn", "--group-size", "128",
                      "--group-fallback", "--mixed", "embed8", "--format", "zp")
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "config.json").read_text())["quantization"]
    assert record["recipe"] == "embed8"
    assert record["layers"]["model.embed_tokens"] == {"bits": 8, "group_size": 64}
    assert record["layers"]["model.layers.0.self_attn.q_proj"] == {"bits": 4, "group_size": 64}
    assert "model.layers.0.mlp.down_proj" not in record["layers"]  # 128 wide: g128 fits


@pytest.mark.slow
def test_smollm2_zp_and_mlx_formats_give_the_same_logits(smollm2_dir, smollm2_q8_dirs,
                                                         monkeypatch):
    from mlx_lm import load as mlx_lm_load

    from mlxspec.load import load

    zp_dir, mlx_dir = smollm2_q8_dirs["zp"], smollm2_q8_dirs["mlx"]
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


def test_mixed_auto_measures_sensitivity_and_records_it(tiny_dir, tmp_path):
    out = tmp_path / "auto"
    result = quantize(str(tiny_dir), "--out", str(out), "--method", "rtn", "--group-size", "32",
                      "--mixed", "auto:5", "--format", "zp")
    assert result.returncode == 0, result.stderr
    assert "by measured sensitivity within 5 bits per weight" in result.stdout
    record = json.loads((out / "config.json").read_text())["quantization"]
    assert record["recipe"] == "sensitivity:5" and record["sensitivity"]
    assert {spec["bits"] for spec in record["layers"].values()} == {8}
    assert_one_line_error(quantize(str(tiny_dir), "--out", str(tmp_path / "x"), "--mixed",
                                   "auto:lots"), "give auto or auto:BPW")


def test_the_cli_spells_the_library_choices():
    from mlxspec.cli import quantize as command
    from mlxspec.quant.quantize import METHODS
    from mlxspec.quant.storage import FORMATS

    assert set(command.METHODS) == set(METHODS)
    assert set(command.FORMATS) == set(FORMATS)


def test_act_order_without_a_method_means_gptq(tiny_dir, tmp_path):
    """The default method (awq+gptq) has no act-order; asking for act-order alone picks GPTQ
    instead of refusing a flag combination the user never wrote."""
    from mlxspec import quantize_to_dir
    from mlxspec.errors import QuantizationError

    report = quantize_to_dir(tiny_dir, tmp_path / "act", group_size=32, act_order=True,
                             output_format="zp", calibration_windows=2, calibration_tokens=32,
                             evaluate=False, progress=False)
    assert report.quantization["method"] == "gptq" and report.quantization["act_order"] is True
    with pytest.raises(QuantizationError, match="--act-order applies to --method gptq only"):
        quantize_to_dir(tiny_dir, tmp_path / "x", act_order=True, method="awq+gptq",
                        output_format="zp", progress=False)


def test_quantize_to_dir_reports_what_it_did_and_gates_against_the_source(tiny_dir, tmp_path):
    from mlxspec import quantize_to_dir
    from mlxspec.evaluation import read_results

    steps = []
    report = quantize_to_dir(
        tiny_dir, tmp_path / "q8", bits=8, group_size=32, method="rtn", progress=False,
        on_step=lambda step, _report: steps.append(step),
    )
    assert steps == ["quantized", "saved", "evaluated"]
    assert report.out_dir == (tmp_path / "q8").absolute() and report.weight_bytes > 0
    assert report.quantization["bits"] == 8 and report.passed is True
    stored = read_results(tmp_path / "q8")
    assert stored == report.evaluation and stored["reference"] == str(tiny_dir)
    assert stored["results"]["kl_mean"] < 0.01
    assert json.loads(json.dumps(report.as_dict()))["passed"] is True
    saved = json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"]
    assert saved["format"] == "mlx"  # the default: plain mlx-lm loads it


# -- issue 10: nothing lost, refused before the slow work ----------------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the model gets loaded: the refusals below must come before that."""
    import importlib

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was refused")

    # the module, not the function mlxspec.load
    monkeypatch.setattr(importlib.import_module("mlxspec.load"), "load", load)


@pytest.fixture
def source(tiny_dir, tmp_path) -> Path:
    """A private copy of the tiny model inside tmp_path/work (so its parent can be targeted)."""
    copy = tmp_path / "work" / "source"
    copy.mkdir(parents=True)
    for p in tiny_dir.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    return copy


@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize("where, relation", [
    (lambda src: src, "the same as"),
    (lambda src: src / "inner", "inside"),
    (lambda src: src.parent, "a parent of"),
])
def test_out_is_never_the_source_inside_it_or_above_it(source, no_model_load, where, relation,
                                                      force):
    before = tree(source.parent)
    result = quantize(str(source), "--out", str(where(source)), *force)
    assert_one_line_error(result, relation, "the source model", "choose a new directory")
    assert tree(source.parent) == before


@pytest.mark.parametrize("where", [lambda ref: ref, lambda ref: ref / "x", lambda ref: ref.parent])
def test_out_is_never_the_reference_inside_it_or_above_it(source, tiny_dir, tmp_path,
                                                          no_model_load, where):
    reference = tmp_path / "elsewhere" / "reference"
    reference.parent.mkdir()
    reference.mkdir()
    for p in tiny_dir.iterdir():
        (reference / p.name).write_bytes(p.read_bytes())
    before = tree(reference.parent)
    result = quantize(str(source), "--out", str(where(reference)), "--force", "--reference",
                      str(reference), evaluate=True)
    assert_one_line_error(result, "the reference model", "choose a new directory")
    assert tree(reference.parent) == before


def test_out_dot_with_force_is_refused_and_the_working_directory_kept(source, tmp_path,
                                                                      monkeypatch,
                                                                      no_model_load):
    cwd = tmp_path / "home" / "cwd"  # neither it nor its parent holds the source
    cwd.mkdir(parents=True)
    (cwd / "notes.txt").write_text("precious")
    monkeypatch.chdir(cwd)
    for out in (".", ".."):
        assert_one_line_error(quantize(str(source), "--out", out, "--force"),
                              "working directory")
    assert (cwd / "notes.txt").read_text() == "precious"


def test_force_replaces_only_a_directory_mlxspec_wrote(source, tmp_path, no_model_load):
    mine = tmp_path / "documents"
    mine.mkdir()
    (mine / "thesis.txt").write_text("precious")
    assert_one_line_error(quantize(str(source), "--out", str(mine), "--force"),
                          "not a model directory mlxspec wrote")
    assert (mine / "thesis.txt").read_text() == "precious"


@pytest.mark.skipif(sys.platform != "linux", reason="/proc is Linux's (macOS has none)")
def test_unwritable_out_is_refused_before_loading(source, no_model_load):
    # /proc refuses new entries even to root (chmod cannot show this when tests run as root).
    assert_one_line_error(quantize(str(source), "--out", "/proc/mlxspec-q4"), "cannot write")


def test_full_disk_is_refused_before_loading(source, tmp_path, monkeypatch, no_model_load):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000))
    result = quantize(str(source), "--out", str(tmp_path / "q4"))
    assert_one_line_error(result, "MB free", "needs about")
    assert not (tmp_path / "q4").exists()


@pytest.mark.parametrize("rule, needle", [
    ({"match": "(unclosed", "bits": 8}, "not a valid regular expression"),
    ({"match": "mlp", "layers": [[0.5, 0.2]], "bits": 8}, '"layers" must be'),
    ({"match": "mlp", "layers": "all", "bits": 8}, '"layers" must be'),
    ({"bits": 8}, 'needs "match"'),
])
def test_bad_recipes_are_refused_before_loading(source, tmp_path, no_model_load, rule, needle):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"kind": "quantization-recipe", "rules": [rule]}))
    assert_one_line_error(quantize(str(source), "--out", str(tmp_path / "q4"), "--mixed",
                                   str(recipe)), needle)


def test_a_gguf_source_file_is_protected_as_given(tmp_path):
    from mlxspec.errors import QuantizationError
    from mlxspec.publish.quantize_flow import check_output_dir

    gguf = tmp_path / "models" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    with pytest.raises(QuantizationError, match="a parent of"):
        check_output_dir(tmp_path / "models", protected=[("source", gguf)], force=True)
    assert check_output_dir(tmp_path / "q4", protected=[("source", gguf)], force=False) == (
        tmp_path / "q4")
    assert gguf.read_bytes() == b"GGUF"


@pytest.fixture
def no_conversion(monkeypatch, no_model_load):
    """Fail the test if a model gets resolved (a GGUF converted into the cache, a download)."""
    import importlib

    def resolve_model_path(*args, **kwargs):
        raise AssertionError("the source was converted or downloaded before the refusal")

    monkeypatch.setattr(importlib.import_module("mlxspec.load"), "resolve_model_path",
                        resolve_model_path)


@pytest.mark.parametrize("out, needle", [
    (lambda root: root / "models", "a parent of the source model"),
    (lambda root: root / "models" / "m.gguf" / "x", "inside the source model"),
    (lambda root: ".", "working directory"),
    pytest.param(lambda root: "/proc/mlxspec-q8", "cannot write to /proc",
                 marks=pytest.mark.skipif(sys.platform != "linux",
                                          reason="/proc is Linux's (macOS has none)")),
])
def test_a_gguf_source_is_not_converted_before_the_output_is_refused(tmp_path, monkeypatch,
                                                                     no_conversion, out, needle):
    gguf = tmp_path / "models" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF not really")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    before = tree(tmp_path)
    result = quantize(str(gguf), "--out", str(out(tmp_path)), "--force")
    assert_one_line_error(result, needle)
    assert tree(tmp_path) == before


def test_json_prints_the_report_and_nothing_else(tiny_dir, tmp_path):
    result = quantize(str(tiny_dir), "--out", str(tmp_path / "q8"), "--bits", "8", "--method",
                      "rtn", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["out_dir"] == str((tmp_path / "q8").absolute()) and report["bits"] == 8
    assert report["evaluation"] is None and report["passed"] is None  # --no-eval
    assert report["weight_bytes"] == sum(
        f.stat().st_size for f in (tmp_path / "q8").glob("*.safetensors"))
