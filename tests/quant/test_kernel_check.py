"""``mlxspec doctor --kernels`` run for real with its kernels emulated (``MLXSPEC_KERNELS=emulate``):
each case labelled by the path it took, a failing kernel a report line that is not timed, every
timed row compared, the per-shape choice for one row as for more, the report one JSON file with
the machine's facts. On a Mac the same code runs the real kernels; only the numbers differ."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner

from mlxspec.metal import emulator
from mlxspec.quant import kernel_check, kernel_timing, kernels

needs_emulator = pytest.mark.skipif(emulator.unavailable() is not None,
                                    reason=str(emulator.unavailable()))
SMALL = {"bits": (4,), "group_sizes": (64,), "dtypes": [(mx.float32, mx.float32)],
         "qmm_rows": (3,)}


@pytest.fixture
def emulate(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXSPEC_KERNELS", "emulate")
    # (not MLXSPEC_HOME: a fresh home rebuilds every compiled helper the report describes)
    monkeypatch.setattr(kernels, "qmm_choice_path", lambda: tmp_path / "qmm_choice.json")
    monkeypatch.delenv("MLXSPEC_QMM", raising=False)
    monkeypatch.delenv("MLXSPEC_QMV", raising=False)
    kernels._measured_speedups.cache_clear()
    yield
    kernels._measured_speedups.cache_clear()


def by_path(report: dict) -> dict[str, dict]:
    return {c["path"]: c for c in report["cases"]}


@needs_emulator
def test_each_case_is_labelled_by_the_path_it_really_took(emulate, monkeypatch):
    from mlxspec.cli import render

    report = kernel_check.check_on_device(**SMALL)
    cases = by_path(report)
    assert report["ok"] and report["emulated"]
    assert cases["zp_qmv M=1"]["kernels"] == ["zp_qmv"]
    assert cases["zp_qmm M=3"]["kernels"] == ["zp_qmm"]
    assert cases["zp_dequantize"]["kernels"] == ["zp_dequantize"]
    # Nothing measured: one row on the decode kernel, more on MLX's own quantized matmul, and
    # those cases say so instead of passing as kernel checks.
    assert cases["matmul M=1 -> zp_qmv"]["kernels"] == ["zp_qmv"]
    for m in (3, 16, 33):
        assert cases[f"matmul M={m} -> mx.quantized_matmul"]["kernels"] == []
    assert all(c["max_rel_error"] < 1e-5 for c in report["cases"])
    assert "skipped" in report["real_shapes"] and "151936x896" in report["real_shapes"]
    # Emulated timings run the code path on a small layer and are never saved as a choice.
    assert [(t["path"], t["rows"]) for t in report["timing"]] == [("zp_qmv", 1), ("zp_qmm", 4)]
    assert all(t["ok"] and t["emulated"] for t in report["timing"])
    assert not kernels.qmm_choice_path().exists()
    lines = render.kernel_check_lines(report)
    assert all("emulated" in line for line in lines)
    monkeypatch.setenv("MLXSPEC_QMM", "zp")
    assert "matmul M=3 -> zp_qmm" in by_path(kernel_check.check_on_device(timing=False, **SMALL))


@needs_emulator
def test_a_kernel_that_does_not_compile_is_a_report_line_and_is_not_timed(emulate, monkeypatch):
    from mlxspec.cli import render

    def broken(name):
        source = kernels._source(f"{name}.metal")
        if name == "zp_qmm":
            source = source.replace("float acc[ROWS][BM];", "float acc[ROWS][BM] = nonsense;")
        return kernels.make_kernel(name, source, kernels._source("zp_common.h"))

    monkeypatch.setattr(kernels, "_kernel", broken)
    report = kernel_check.check_on_device(**SMALL)
    failed = [c for c in report["cases"] if not c["ok"]]
    assert not report["ok"] and [c["path"] for c in failed] == ["zp_qmm M=3"]
    assert failed[0]["error"].startswith("zp_qmm (emulated): g++ failed")
    timing = {t["path"]: t for t in report["timing"]}
    assert timing["zp_qmv"]["ok"] and "failed its check" in timing["zp_qmm"]["skipped"]
    lines = render.kernel_check_lines(report)
    assert lines[0].startswith("kernel check: FAILED")
    assert any("zp_qmm M=3" in line and "FAILED" in line for line in lines)
    assert any("M=4: skipped: zp_qmm failed its check" in line for line in lines)


@needs_emulator
def test_every_timed_row_is_compared_with_the_fallback(emulate, monkeypatch):
    row = kernel_timing.benchmark_matmul(64, 256, bits=4, group_size=64, rows=8, iters=1,
                                         working_set_mb=0, dtype=mx.float32,
                                         scale_dtype=mx.float32)
    assert row["ok"] and row["path"] == "zp_qmm" and row["max_rel_error"] < 1e-5
    assert row["zp_us"] > 0 and row["speedup"] == pytest.approx(row["affine_us"] / row["zp_us"])

    def wrong_nibbles(name):  # a kernel that runs but reads the nibbles in reverse order
        header = kernels._source("zp_common.h").replace("(w >> (4 * j))", "(w >> (28 - 4 * j))")
        return kernels.make_kernel(name, kernels._source(f"{name}.metal"), header)

    monkeypatch.setattr(kernels, "_kernel", wrong_nibbles)
    row = kernel_timing.benchmark_matmul(64, 256, bits=4, group_size=64, rows=1, iters=1,
                                         working_set_mb=0)
    assert not row["ok"] and row["max_rel_error"] > 0.1


def test_measured_timings_choose_each_kernel_per_bits_group_and_rows(emulate, monkeypatch):
    kernels.save_qmm_choice([{"bits": 4, "group_size": 32, "rows": 1, "speedup": 0.8},
                             {"bits": 8, "group_size": 32, "rows": 1, "speedup": 1.4},
                             {"bits": 4, "group_size": 32, "rows": 4, "speedup": 1.3},
                             {"bits": 4, "group_size": 32, "rows": 8, "speedup": 0.7}])
    # One row: the decode kernel unless measured slower here (4-bit g32), as measured elsewhere.
    assert kernels.route(1, 4, 32) == "affine" and kernels.route(1, 8, 32) == "zp_qmv"
    assert kernels.route(1, 4, 64) == "zp_qmv"  # not measured
    assert "mx.quantized_matmul for 4-bit g32" in kernels.describe()
    # 2-16 rows: zp_qmm only where measured faster, at the nearest measurement at or above.
    assert kernels.route(3, 4, 32) == "zp_qmm" and kernels.route(4, 4, 32) == "zp_qmm"
    assert kernels.route(5, 4, 32) == "affine" and kernels.route(3, 8, 32) == "affine"
    assert "zp_qmm where measured faster (4-bit g32 M<=4)" in kernels.describe()
    monkeypatch.setenv("MLXSPEC_QMV", "zp")
    monkeypatch.setenv("MLXSPEC_QMM", "affine")
    assert kernels.route(1, 4, 32) == "zp_qmv" and kernels.route(3, 4, 32) == "affine"
    monkeypatch.delenv("MLXSPEC_QMV")
    monkeypatch.delenv("MLXSPEC_QMM")
    monkeypatch.setattr(kernels, "device_name", lambda: "another GPU")
    kernels._measured_speedups.cache_clear()
    assert kernels.route(1, 4, 32) == "zp_qmv" and kernels.route(3, 4, 32) == "affine"
    kernels.qmm_choice_path().write_text("{not json")
    kernels._measured_speedups.cache_clear()
    assert kernels.route(1, 4, 32) == "zp_qmv"


def test_an_unknown_kernels_setting_is_one_clear_error(monkeypatch):
    from mlxspec.errors import QuantizationError

    monkeypatch.setenv("MLXSPEC_KERNELS", "metal")
    with pytest.raises(QuantizationError, match="choose auto, mlx or emulate"):
        kernels.backend()


@needs_emulator
def test_doctor_kernels_writes_one_json_report_with_the_machine(emulate, monkeypatch, tmp_path):
    from mlxspec.cli.main import cli

    monkeypatch.setattr(kernel_check, "EMULATED_GRID", SMALL)
    out = tmp_path / "report.json"
    result = CliRunner().invoke(cli, ["doctor", "--kernels", "--no-measure", "-o", str(out)])
    assert result.exit_code == 0, result.output
    check_lines = result.stdout[result.stdout.index("kernel check:"):].splitlines()[:-1]
    assert check_lines[0].startswith("kernel check: all ok (emulated")
    assert all("emulated" in line for line in check_lines)
    assert f"report written to {out}" in result.output
    report = json.loads(out.read_text())
    assert report["kernel_check"]["ok"] and report["os"] and report["cpu"]
    assert report["memory_gb"] > 0 and "device_name" in report["device_info"]
    assert "EMULATED" in report["quantized_matmul"]
    # finding 6: the default model in Metal's dtype against float32 (here quality only)
    dtype_check = report["default_model_dtype"]
    assert dtype_check["ok"] and dtype_check["activations"] == "float16", dtype_check
    assert "default_model_dtype:" in result.stdout and "gguf_dtype" in report


@needs_emulator
def test_the_mac_report_runs_end_to_end_on_small_shapes(monkeypatch, tmp_path):
    """The Metal (not emulated) branch: real shapes with a chunked reference, the choice saved,
    the float32-scale rows, the GPU copy. Here ``mx.metal`` is said to be there and the tests'
    harness emulates the launches; the shapes are shrunk, the code is the Mac's."""
    from emulated_kernels import emulated

    from mlxspec.cli import render

    monkeypatch.delenv("MLXSPEC_KERNELS", raising=False)
    monkeypatch.delenv("MLXSPEC_QMM", raising=False)
    monkeypatch.setattr(kernels, "qmm_choice_path", lambda: tmp_path / "qmm_choice.json")
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(kernel_check, "REAL_SHAPES", [("a head", 100, 128)])
    monkeypatch.setattr(kernel_check, "REFERENCE_CHUNK", 64)  # two chunks
    timed = kernel_timing.benchmark_matmul

    def small(n, k, **kwargs):
        return timed(64, 256, **{**kwargs, "iters": 1, "working_set_mb": 0})

    monkeypatch.setattr(kernel_timing, "benchmark_matmul", small)
    monkeypatch.setattr(kernel_check, "TIMING", {**kernel_check.TIMING, "bits": (4,),
                                                 "group_sizes": (64,), "rows": (1, 4)})
    monkeypatch.setattr(kernel_timing, "gpu_copy_bandwidth", lambda: 100.0)
    kernels._measured_speedups.cache_clear()
    with emulated():
        report = kernel_check.check_on_device(**SMALL)
    kernels._measured_speedups.cache_clear()
    real = [c for c in report["cases"] if "shape" in c]
    assert report["ok"] and not report["emulated"] and len(real) == 2 * 6
    assert {c["shape"] for c in real} == {"a head 100x128"}
    saved = json.loads((tmp_path / "qmm_choice.json").read_text())
    assert [(r["bits"], r["rows"]) for r in saved["rows"]] == [(4, 1), (4, 4)]
    scale_rows = [t for t in report["timing"] if t["dtype"] == "float32"]
    assert [t["scale_dtype"] for t in scale_rows] == ["float32", "float16"]
    lines = render.kernel_check_lines(report)
    assert not any("emulated" in line for line in lines)
    assert any("(scales float32)" in line for line in lines) and "GPU copy bandwidth" in lines[-2]
