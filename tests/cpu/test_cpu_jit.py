"""mlxspec.cpu.jit: MLX's JIT kernels built with the CPU's AVX2/FMA give bitwise the same results.

The reference is MLX's own build of the same kernels (``MLXSPEC_JIT_FLAGS=0``), each process
with a kernel cache of its own (``TMPDIR``), so neither loads the other's kernels. The speed is
measured in ``bench/fused_ops.py``, not here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cpu_builds import home_sharing_cpu_builds

from mlxspec.cpu import jit as cpu_jit

pytestmark = pytest.mark.skipif(
    not (cpu_jit._cpu_supported() and shutil.which("g++")),
    reason="needs Linux x86-64 with AVX2/FMA/F16C and g++ (MLX's CPU JIT); elsewhere nothing "
           "changes")

KERNELS = r"""
import json, sys
import numpy as np
import mlxspec
from mlxspec.cpu import jit as cpu_jit
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

model, _ = mlxspec.load(sys.argv[2])  # as users get it: load() sets the build up
enabled = cpu_jit.enabled()
rng = np.random.default_rng(0)
special = np.array([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 88.1, -88.1, 87.9, -87.9, 1e4, -1e4,
                    np.inf, -np.inf, np.nan], np.float32)
x = np.concatenate([rng.uniform(-100, 100, 300_000), rng.normal(0, 4, 300_000), special])
x = mx.array(x.astype(np.float32))
y = mx.array(rng.normal(0, 2, x.size).astype(np.float32))
outputs = {
    "swiglu": swiglu(x, y),  # mlx-lm's compiled SiLU(gate) * up
    "exp": mx.compile(mx.exp)(x),
    "sigmoid": mx.compile(mx.sigmoid)(x),
    "gelu_approx": mx.compile(nn.gelu_approx)(x),  # tanh
    "softplus": mx.compile(lambda a: mx.logaddexp(a, 0.0))(x),
    "rsqrt_norm": mx.compile(lambda a, b: a * mx.rsqrt(mx.abs(b) + 1e-6))(x, y),
    "half": mx.compile(lambda a, b: (a.astype(mx.float16) * b.astype(mx.float16)).astype(mx.float32))(x, y),
    "bf16_silu": mx.compile(lambda a: nn.silu(a.astype(mx.bfloat16)).astype(mx.float32))(x),
}
np.savez(sys.argv[1], **{k: np.array(v) for k, v in outputs.items()})
print(json.dumps({"enabled": enabled}))
"""


def _run(tmp_path: Path, model_dir: Path, name: str, **env: str) -> dict:
    cache = tmp_path / f"tmp_{name}"
    # As on a machine where mlxspec ran before (its stamp there): nothing is cleared, so a kernel
    # built before load() put the flags in place would stay on disk, as built, and show below.
    import mlx.core as mx

    kernels = cache / "mlx" / mx.__version__ / "cpu"
    kernels.mkdir(parents=True)
    (kernels / cpu_jit.STAMP).write_text(" ".join(cpu_jit.FLAGS) + "\n")
    out = tmp_path / f"{name}.npz"
    home = home_sharing_cpu_builds(tmp_path / "home")  # MLX's JIT cache is the fresh one here
    environment = {**os.environ, "TMPDIR": str(cache), "MLXSPEC_HOME": str(home),
                   "OPENBLAS_NUM_THREADS": "1", **env}
    proc = subprocess.run([sys.executable, "-c", KERNELS, str(out), str(model_dir)],
                          capture_output=True,
                          text=True, env=environment, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["outputs"] = dict(np.load(out))
    report["kernels"] = {p.name: _uses_ymm(p) for p in (cache / "mlx").rglob("lib*.so")}
    return report


def _uses_ymm(library: Path) -> bool:
    """Whether a kernel's code uses 256-bit registers (AVX2 vectorized). Its bytes cannot tell:
    MLX builds from a temporary file name, which every build embeds."""
    if not shutil.which("objdump"):
        pytest.skip("objdump (binutils) is needed to read the kernels' instructions")
    code = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True,
                          check=True).stdout
    return "%ymm" in code


def test_kernels_with_the_cpu_flags_are_bitwise_mlx_own(tmp_path, smollm2_dir):
    flagged = _run(tmp_path, smollm2_dir, "flagged")
    plain = _run(tmp_path, smollm2_dir, "plain", MLXSPEC_JIT_FLAGS="0")
    assert flagged["enabled"] and not plain["enabled"]
    assert flagged["kernels"] and flagged["kernels"].keys() == plain["kernels"].keys()
    # the same kernels; SiLU's vectorized only with the flags (they reached the compiler before
    # load() built anything: a kernel built earlier would stay as built, the stamp being there)
    silu = [k for k in plain["kernels"] if "Sigmoid" in k]
    assert silu and all(flagged["kernels"][k] and not plain["kernels"][k] for k in silu), silu
    for name, reference in plain["outputs"].items():
        got = flagged["outputs"][name]
        same = (got.view(np.uint32) == reference.view(np.uint32)) | (
            np.isnan(got) & np.isnan(reference))
        assert same.all(), f"{name}: {int((~same).sum())} of {same.size} values differ"
    # and they are the functions they claim to be (a wrong kernel in both would agree)
    x = plain["outputs"]["exp"]
    finite = np.isfinite(x) & (x > 1e-30) & (x < 1e30)
    assert finite.sum() > 100_000


def _compile(compiler: Path, output: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    source = tmp_path / "probe.cpp"
    source.write_text("#ifndef __AVX2__\n#error built without AVX2\n#endif\nint probe() { return 1; }\n")
    output.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.run([str(compiler), "-std=c++17", "-O3", "-fPIC", "-shared", str(source),
                           "-o", str(output)], capture_output=True, text=True, timeout=120)


def test_the_wrapper_adds_flags_to_mlx_builds_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    wrapper = cpu_jit._write_wrapper(shutil.which("g++"))
    assert wrapper.parent.name != "bin" and [p.name for p in wrapper.parent.iterdir()] == ["g++"]
    mlx_build = _compile(wrapper, tmp_path / "t" / "mlx" / "0.0.0" / "cpu" / "tmp_x.so", tmp_path)
    assert mlx_build.returncode == 0, mlx_build.stderr
    other = _compile(wrapper, tmp_path / "elsewhere" / "libx.so", tmp_path)
    assert other.returncode != 0 and "built without AVX2" in other.stderr  # passed through as is
    for variable in ("MLXSPEC_JIT_FLAGS", "MLXSPEC_FUSED_OPS"):  # a child process switched off
        monkeypatch.setenv(variable, " Off")
        switched = _compile(wrapper, tmp_path / "t" / "mlx" / "0.0.0" / "cpu" / "tmp_y.so", tmp_path)
        assert switched.returncode != 0 and "built without AVX2" in switched.stderr
        monkeypatch.delenv(variable)
    version = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True)
    assert version.stdout == subprocess.run(["g++", "--version"], capture_output=True,
                                            text=True).stdout
    assert cpu_jit._write_wrapper(shutil.which("g++")) == wrapper  # content-addressed: reused


def test_old_kernels_are_cleared_once_per_set_of_flags(tmp_path, monkeypatch):
    directory = tmp_path / "mlx" / "1.2.3" / "cpu"
    directory.mkdir(parents=True)
    (directory / "libold.so").write_bytes(b"old")
    (directory / "old.cpp").write_text("source")
    cpu_jit._clear_old_kernels(directory)
    assert sorted(p.name for p in directory.iterdir()) == [cpu_jit.STAMP, "old.cpp"]
    (directory / "libnew.so").write_bytes(b"built with the flags")
    cpu_jit._clear_old_kernels(directory)  # stamped: kept
    assert (directory / "libnew.so").exists()
    monkeypatch.setattr(cpu_jit, "FLAGS", (*cpu_jit.FLAGS, "-fexample"))
    cpu_jit._clear_old_kernels(directory)  # other flags: cleared again
    assert not (directory / "libnew.so").exists()
    assert (directory / cpu_jit.STAMP).read_text().split() == list(cpu_jit.FLAGS)


def test_kernel_dir_follows_cpp_temp_directory(monkeypatch):
    import mlx.core as mx

    for variable in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(variable, raising=False)
    assert cpu_jit.kernel_dir() == Path("/tmp/mlx") / mx.__version__ / "cpu"
    monkeypatch.setenv("TEMP", "/some/temp")
    monkeypatch.setenv("TMP", "/other")  # C++ reads TMP before TEMP
    assert cpu_jit.kernel_dir() == Path("/other/mlx") / mx.__version__ / "cpu"


@pytest.mark.parametrize("variable", ["MLXSPEC_FUSED_OPS", "MLXSPEC_JIT_FLAGS"])
def test_switched_off(monkeypatch, variable):
    monkeypatch.setattr(cpu_jit, "_wrapper_dir", None)
    monkeypatch.setenv(variable, "0")
    path = os.environ["PATH"]
    assert not cpu_jit.enable() and os.environ["PATH"] == path
    assert cpu_jit.describe().startswith("MLX's default build (MLXSPEC_JIT_FLAGS=0")
