"""MLX on the optimized BLAS (mlxspec.cpu.blas): same numbers as float64 numpy, and really in use.

Each BLAS choice needs a fresh process (the choice is made before ``mlx.core`` is imported), so the
MLX side runs in a subprocess with ``MLXSPEC_BLAS`` set and the float64 references are computed
here. ``run_with_blas`` is the helper for any such comparison (the last test compares greedy
tokens of the real default model under ``MLXSPEC_BLAS=reference`` and the default).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cpu_builds import home_sharing_cpu_builds

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="mlxspec.cpu.blas only acts on Linux (macOS MLX uses Accelerate)"
)

EPS32 = float(np.finfo(np.float32).eps)


def _mlx_cpu_libs() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("mlx")
    return Path(next(iter(spec.submodule_search_locations))).parent / "mlx_cpu.libs"


def run_with_blas(code: str, blas: str | None, home: Path, **env: str) -> dict:
    """Run ``code`` in a fresh Python with ``MLXSPEC_BLAS=blas`` (None: unset); return its result.

    ``code`` must print one JSON object as its last line of stdout. ``home`` is ``MLXSPEC_HOME``
    (where the shim is compiled). ``env`` adds environment variables.
    """
    environment = {**os.environ, "MLXSPEC_HOME": str(home), **env}
    environment.pop("MLXSPEC_BLAS", None)
    if blas is not None:
        environment["MLXSPEC_BLAS"] = blas
    result = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """One MLXSPEC_HOME for the module, so the shim is compiled once (the CPU ops and kernels,
    which the shim's tests do not concern, are the session's)."""
    return home_sharing_cpu_builds(tmp_path_factory.mktemp("mlxspec_home"))


# -- matmul and LAPACK numerics against float64 numpy ---------------------------------------------


def _inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    n = 40
    spd = normal(n, n)
    well_conditioned = np.eye(n, dtype=np.float32) * 8 + normal(n, n)
    basis = np.eye(n, dtype=np.float32) + 0.1 * normal(n, n)
    known_eigenvalues = (
        basis @ np.diag(np.arange(1, n + 1, dtype=np.float32)) @ np.linalg.inv(basis)
    )
    return {
        "x1": normal(1, 576),
        "x7": normal(7, 576),
        "w": normal(1536, 576),
        "a": normal(33, 65),
        "b": normal(65, 17),
        "at": normal(65, 33),
        "c": normal(33, 17),
        "ba": normal(3, 5, 31),
        "bb": normal(3, 31, 9),
        "ba4": normal(2, 3, 5, 31),
        "b2": normal(31, 9),
        "big_a": normal(256, 300),
        "big_b": normal(300, 260),
        "d_a": rng.standard_normal((20, 30)),
        "d_b": rng.standard_normal((30, 10)),
        "spd": (spd @ spd.T + n * np.eye(n)).astype(np.float32),
        "g": well_conditioned.astype(np.float32),
        "lower": np.tril(well_conditioned).astype(np.float32),
        "eig": known_eigenvalues.astype(np.float32),
        "cplx_a": (normal(9, 12) + 1j * normal(9, 12)).astype(np.complex64),
        "cplx_b": (normal(12, 5) + 1j * normal(12, 5)).astype(np.complex64),
    }


# MLX side, run in the child. Every product goes through cblas_?gemm, every linalg call LAPACK.
MLX_CASES = r"""
import json, sys, warnings
import numpy as np
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import mlxspec  # chooses the BLAS before mlx.core is imported
    from mlxspec.cpu import blas
    blas.setup()  # a second call must neither act nor warn again
import mlx.core as mx

x = {k: mx.array(v) for k, v in np.load(sys.argv[1]).items()}
x["d_a"], x["d_b"] = (mx.array(np.load(sys.argv[1])[k], dtype=mx.float64) for k in ("d_a", "d_b"))
cpu = mx.cpu
q, r = mx.linalg.qr(x["g"], stream=cpu)
cases = {
    "matvec_transposed": x["x1"] @ x["w"].T,
    "odd_m_transposed": x["x7"] @ x["w"].T,
    "odd_sizes": x["a"] @ x["b"],
    "transposed_a": x["at"].T @ x["b"],
    "transposed_both": x["b"].T @ x["a"].T,
    "batched": x["ba"] @ x["bb"],
    "broadcast_batched": x["ba4"] @ x["b2"],
    "addmm": mx.addmm(x["c"], x["a"], x["b"], alpha=0.5, beta=2.0),
    "large": x["big_a"] @ x["big_b"],
    "float64": x["d_a"] @ x["d_b"],
    "complex64": x["cplx_a"] @ x["cplx_b"],
    "inv": mx.linalg.inv(x["g"], stream=cpu),
    "tri_inv": mx.linalg.tri_inv(x["lower"], upper=False, stream=cpu),
    "cholesky": mx.linalg.cholesky(x["spd"], stream=cpu),
    "eigvalsh": mx.linalg.eigvalsh(x["spd"], stream=cpu),
    "svdvals": mx.linalg.svd(x["g"], compute_uv=False, stream=cpu),
    "eigvals": mx.linalg.eigvals(x["eig"], stream=cpu),
    "q": q,
    "r": r,
}
mx.eval(cases)
np.savez(sys.argv[2], **{k: np.array(v) for k, v in cases.items()})
from mlxspec.cpu import blas_info
report = blas_info.blas_report(measure=False)
report["warnings"] = [str(w.message) for w in caught if "mlxspec" in str(w.message)]
print(json.dumps(report))
"""


def _bound(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rigorous float32 error bound of a @ b: K * eps * (|a| @ |b|) (twice the classical one)."""
    k = a.shape[-1]
    return k * EPS32 * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)) + 1e-30


def _check_against_float64(inputs: dict, out: dict) -> None:
    f64 = {
        k: v.astype(np.complex128 if np.iscomplexobj(v) else np.float64) for k, v in inputs.items()
    }
    products = {
        "matvec_transposed": (inputs["x1"], inputs["w"].T),
        "odd_m_transposed": (inputs["x7"], inputs["w"].T),
        "odd_sizes": (inputs["a"], inputs["b"]),
        "transposed_a": (inputs["at"].T, inputs["b"]),
        "transposed_both": (inputs["b"].T, inputs["a"].T),
        "batched": (inputs["ba"], inputs["bb"]),
        "broadcast_batched": (inputs["ba4"], inputs["b2"]),
        "large": (inputs["big_a"], inputs["big_b"]),
        "complex64": (inputs["cplx_a"], inputs["cplx_b"]),
    }
    for name, (a, b) in products.items():
        reference = a.astype(np.complex128 if np.iscomplexobj(a) else np.float64) @ b
        error = np.abs(out[name] - reference)
        assert out[name].shape == reference.shape, name
        assert np.all(error <= 2 * _bound(a, b)), f"{name}: max error {error.max():.3g}"

    addmm = 2.0 * f64["c"] + 0.5 * (f64["a"] @ f64["b"])
    bound = 0.5 * _bound(inputs["a"], inputs["b"]) + 4 * EPS32 * np.abs(addmm)
    assert np.all(np.abs(out["addmm"] - addmm) <= bound)

    float64 = f64["d_a"] @ f64["d_b"]
    assert out["float64"].dtype == np.float64
    np.testing.assert_allclose(out["float64"], float64, rtol=1e-12, atol=1e-12)

    # LAPACK results: float32 inputs are exact in float64; the matrices are well conditioned.
    np.testing.assert_allclose(out["inv"], np.linalg.inv(f64["g"]), atol=2e-5)
    np.testing.assert_allclose(out["tri_inv"], np.linalg.inv(f64["lower"]), atol=2e-5)
    np.testing.assert_allclose(
        out["cholesky"], np.linalg.cholesky(f64["spd"]), rtol=1e-4, atol=1e-4
    )
    np.testing.assert_allclose(out["eigvalsh"], np.linalg.eigvalsh(f64["spd"]), rtol=1e-4)
    np.testing.assert_allclose(out["svdvals"], np.linalg.svd(f64["g"], compute_uv=False), rtol=1e-4)
    eigenvalues = np.sort_complex(out["eigvals"].astype(np.complex128))
    np.testing.assert_allclose(eigenvalues, np.arange(1, 41), atol=2e-3)
    np.testing.assert_allclose(out["q"] @ out["r"], f64["g"], atol=1e-4)
    np.testing.assert_allclose(out["q"].T @ out["q"], np.eye(40), atol=1e-5)
    assert np.allclose(np.tril(out["r"], -1), 0)


def _run_cases(tmp_path: Path, home: Path, blas: str | None) -> tuple[dict, dict, dict]:
    """Inputs, MLX outputs and the child's BLAS report (with its mlxspec warnings)."""
    inputs = _inputs(np.random.default_rng(0))
    np.savez(tmp_path / "inputs.npz", **inputs)
    code = MLX_CASES.replace("sys.argv[1]", repr(str(tmp_path / "inputs.npz")))
    code = code.replace("sys.argv[2]", repr(str(tmp_path / "out.npz")))
    report = run_with_blas(code, blas, home)
    return inputs, dict(np.load(tmp_path / "out.npz")), report


def test_reference_blas_matches_float64_and_stays_silent(tmp_path, home):
    inputs, out, report = _run_cases(tmp_path, home, "reference")
    assert report["active"] == "reference" and report["shim"] is None
    assert report["forwarded_calls"] is None
    assert "mlx_cpu.libs/libblas" in report["resolved"]
    assert report["warnings"] == []
    _check_against_float64(inputs, out)


def test_openblas_is_the_default_and_matches_float64(tmp_path, home):
    inputs, out, report = _run_cases(tmp_path, home, None)
    assert report["warnings"] == [], report["warnings"]
    assert report["active"] == "openblas"
    assert "libscipy_openblas" in report["library"]
    assert report["config"].startswith("OpenBLAS")
    if not any(variable in os.environ for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        assert 1 <= report["threads"] <= len(os.sched_getaffinity(0))  # see below
    # MLX binds cblas_sgemm to the shim, and every product and factorization went through it:
    # 10 unbatched products + 3 + 6 batched matrices + 7 LAPACK routines (and their queries).
    assert report["resolved"] == report["shim"]
    assert report["forwarded_calls"] >= 10 + 3 + 6 + 7
    _check_against_float64(inputs, out)


def test_library_path_setting_forwards_to_that_library(tmp_path, home):
    # MLX's own reference LAPACK (which pulls in its BLAS) exports the standard names, so it
    # stands in for MKL's libmkl_rt.so or a system libopenblas.so.
    (lapack,) = _mlx_cpu_libs().glob("liblapack-*.so*")
    inputs, out, report = _run_cases(tmp_path, home, str(lapack))
    assert report["warnings"] == []
    assert report["active"] == "custom" and report["library"] == str(lapack)
    assert report["resolved"] == report["shim"] and report["forwarded_calls"] >= 26
    _check_against_float64(inputs, out)


# -- skinny products: the shim's own kernel and the sgemv route ------------------------------------

# Every shape the shim treats specially, with the tails of its loops: 1-24 rows (the kernels'
# instances: 1-8 with AVX2, 1-12 with AVX-512, then even groups), 25 rows (back to sgemm), k
# around their 8- and 16-wide steps, n around the threads' split and the column and row blocks
# (4099 x 64: several blocks of W), a transposed and a strided operand, beta != 0, one column.
# Row i of a product of up to 24 rows must be bitwise the same as that row alone (what batching
# and speculative verification rely on). MLXSPEC_SKINNY_ROWS=8: 9 rows and more to sgemm.
SKINNY = r"""
import json, os, sys
import numpy as np
import mlxspec
from mlxspec.cpu import blas
import mlx.core as mx

rng = np.random.default_rng(0)
normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
cases, arrays = {}, {}
for m in range(1, 26):
    for n, k in [(1, 5), (7, 1), (13, 9), (200, 8), (333, 577), (4099, 64), (6, 31)]:
        arrays[f"nt_{m}_{n}_{k}"] = (normal(m, k), normal(n, k))
        cases[f"nt_{m}_{n}_{k}"] = lambda a, b: a @ b.T
for m in (1, 3):
    arrays[f"nn_{m}"] = (normal(m, 70), normal(70, 45))  # x @ W: sgemv transposed or sgemm
    cases[f"nn_{m}"] = lambda a, b: a @ b
    arrays[f"tn_{m}"] = (normal(70, m), normal(45, 70))  # a transposed: a column of a (70, m)
    cases[f"tn_{m}"] = lambda a, b: a.T @ b.T
arrays["column"] = (normal(6, 70), normal(70, 1))
cases["column"] = lambda a, b: a @ b
arrays["strided"] = (normal(4, 300), normal(50, 130))  # a's rows are 300 apart, k = 130
cases["strided"] = lambda a, b: a[:, 100:230] @ b.T
arrays["strided_20"] = (normal(20, 300), normal(50, 130))  # grouped rows: copied to aligned rows
cases["strided_20"] = lambda a, b: a[:, 100:230] @ b.T
arrays["addmm"] = (normal(3, 50), normal(40, 50))
cases["addmm"] = lambda a, b: mx.addmm(mx.ones((3, 40)), a, b.T, alpha=0.5, beta=2.0)
before = blas.product_routes()
out = {name: np.array(cases[name](mx.array(a), mx.array(b))) for name, (a, b) in arrays.items()}
routes = {key: value - before[key] for key, value in blas.product_routes().items()}
rows = blas._shim.mlxspec_blas_max_rows()  # 24, or MLXSPEC_SKINNY_ROWS=8
a, w = mx.array(normal(rows, 577)), mx.array(normal(333, 577))
batched = np.array(a @ w.T)
alone = [np.array(a[i : i + 1] @ w.T) for i in range(rows)]
# Threads claim chunks of columns as they come: 1, 2 or 3 threads, the same numbers.
x, big = mx.array(normal(5, 577)), mx.array(normal(4099, 577))
threads = blas._shim.mlxspec_blas_threads()
by_threads = []
for t in (1, 2, 3):
    blas._shim.mlxspec_blas_set_threads(t)
    by_threads.append(np.array(x @ big.T))
blas._shim.mlxspec_blas_set_threads(threads)
# The nn kernel (b untransposed, <= 256 columns): a row alone or with others, 16 or 8 lanes, the
# same numbers (one FMA chain per output; mlxspec/_cpu_attention.cpp relies on it).
p, v = mx.array(normal(7, 300)), mx.array(normal(300, 70))
nn_batched = np.array(p @ v)
nn_alone = [np.array(p[i : i + 1] @ v) for i in range(7)]
blas._shim.mlxspec_blas_set_isa(b"avx2")
nn_avx2 = np.array(p @ v)
blas._shim.mlxspec_blas_set_isa(b"avx2" if os.environ.get("MLXSPEC_SKINNY") == "avx2" else None)
# Two MLX streams multiply at once (two threads share the kernel's pool): the same numbers.
other = mx.new_stream(mx.cpu)
both = [mx.matmul(a[: 1 + i % rows], w.T, stream=mx.cpu if i % 2 else other) for i in range(64)]
mx.eval(both)
concurrent_ok = all(np.array_equal(np.array(r), batched[: 1 + i % rows]) for i, r in enumerate(both))
np.savez(sys.argv[1], **{f"in_{k}_{j}": v for k, pair in arrays.items() for j, v in enumerate(pair)},
         **{f"out_{k}": v for k, v in out.items()})
print(json.dumps({"routes": routes, "mode": blas.skinny_products(), "concurrent_ok": concurrent_ok,
                  "threads_independent": all(np.array_equal(by_threads[0], r) for r in by_threads),
                  "row_independent": all(np.array_equal(batched[i : i + 1], alone[i])
                                         for i in range(rows)),
                  "nn_row_independent": all(np.array_equal(nn_batched[i : i + 1], nn_alone[i])
                                            for i in range(7)),
                  "nn_isa_independent": np.array_equal(nn_batched, nn_avx2)}))
"""


@pytest.mark.parametrize("threads, skinny",
                         [("1", "1"), ("2", "1"), ("2", "avx2"), ("2", "rows:8"), ("2", "0")],
                         ids=["1-thread", "2-threads", "avx2", "8-rows", "off"])
def test_skinny_products_match_float64(tmp_path, home, threads, skinny):
    code = SKINNY.replace("sys.argv[1]", repr(str(tmp_path / "out.npz")))
    env = {"MLXSPEC_SKINNY_ROWS": "8"} if skinny == "rows:8" else {"MLXSPEC_SKINNY": skinny}
    report = run_with_blas(code, None, home, OPENBLAS_NUM_THREADS=threads, **env)
    saved = np.load(tmp_path / "out.npz")
    names = sorted(k[4:] for k in saved.files if k.startswith("out_"))
    for name in names:
        a, b = saved[f"in_{name}_0"], saved[f"in_{name}_1"]
        if name.startswith(("nt", "strided")):
            a, b = (a[:, 100:230], b.T) if name.startswith("strided") else (a, b.T)
        elif name.startswith("tn"):
            a, b = a.T, b.T
        elif name == "addmm":
            a, b = a, b.T
        reference = a.astype(np.float64) @ b
        bound = 2 * _bound(a, b)
        if name == "addmm":
            reference = 2.0 + 0.5 * reference
            bound = 0.5 * bound + 4 * EPS32 * np.abs(reference)
        error = np.abs(saved[f"out_{name}"] - reference)
        assert np.all(error <= bound), f"{name}: max error {error.max():.3g}"
    if skinny == "0":  # every product went to sgemm, as before the shim computed any itself
        assert report["routes"] == {"skinny": 0, "nn": 0, "gemv": 0}
        assert report["mode"].startswith("off")
        return
    # The routes were taken: the widest kernel the CPU has (AVX-512, else AVX2 and FMA) unless
    # MLXSPEC_SKINNY=avx2 asks for the narrower one, sgemv for one row.
    import platform

    flags = Path("/proc/cpuinfo").read_text() if platform.machine() == "x86_64" else ""
    rows = 8 if skinny == "rows:8" else 24
    if "avx2" in flags:  # 1-24 (or 1-8) rows x 7 shapes, the strided products and addmm
        assert report["routes"]["skinny"] == rows * 7 + 2 + (rows >= 20)
        kernel = "AVX-512 kernel (12" if "avx512f" in flags and skinny != "avx2" else "AVX2/FMA kernel (8"
        assert report["mode"].startswith(f"{kernel} rows at once) for 1-{rows} rows, {threads} thread")
        # nn_1, nn_3 and the column (b untransposed, <= 256 columns): the nn kernel
        assert report["routes"]["nn"] == 3
        assert report["nn_row_independent"] and report["nn_isa_independent"]
    assert report["routes"]["gemv"] >= 1  # a transposed row
    assert report["row_independent"] and report["concurrent_ok"] and report["threads_independent"]


# -- fallbacks: one clear warning, MLX still works --------------------------------------------------

FALLBACK = r"""
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    PRE_IMPORT
    import mlxspec
    from mlxspec.cpu import blas
    blas.setup()
import mlx.core as mx
from mlxspec.cpu import blas_info
report = blas_info.blas_report(measure=False)
report["warnings"] = [str(w.message) for w in caught if "mlxspec" in str(w.message)]
a = mx.arange(12, dtype=mx.float32).reshape(3, 4)
report["product"] = (a @ a.T).tolist()
print(json.dumps(report))
"""


@pytest.mark.parametrize(
    "blas, env, pre_import, expected",
    [
        ("/nonexistent/libopenblas.so", {}, "", "/nonexistent/libopenblas.so is not a file"),
        (None, {"CC": "false"}, "", "compiling the BLAS shim failed"),
        (None, {"MLXSPEC_HOME": "/proc/no-such-dir"}, "", "set MLXSPEC_HOME to a writable"),
        (None, {}, "import mlx.core", "mlx.core was imported before mlxspec"),
    ],
    ids=["missing-library", "no-compiler", "unwritable-home", "mlx-imported-first"],
)
def test_falls_back_to_reference_with_one_warning(tmp_path, blas, env, pre_import, expected):
    # A fresh MLXSPEC_HOME, so the no-compiler case really has to compile.
    report = run_with_blas(FALLBACK.replace("PRE_IMPORT", pre_import), blas, tmp_path, **env)
    assert len(report["warnings"]) == 1, report["warnings"]
    assert expected in report["warnings"][0]
    assert report["active"] == "reference" and report["notice"]
    assert "mlx_cpu.libs/libblas" in report["resolved"]
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    np.testing.assert_array_equal(report["product"], a @ a.T)


def test_leaves_a_preloaded_blas_alone(tmp_path):
    (reference_blas,) = _mlx_cpu_libs().glob("libblas-*.so*")
    code = FALLBACK.replace("PRE_IMPORT", "")
    report = run_with_blas(code, None, tmp_path, LD_PRELOAD=str(reference_blas))
    assert report["warnings"] == []
    assert report["active"] == "preloaded" and report["shim"] is None
    assert report["resolved"] == report["library"] == str(reference_blas.resolve())
    assert not (tmp_path / "blas").exists()  # nothing compiled


# -- the shim covers what MLX imports ---------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_shim_forwards_every_blas_symbol_mlx_imports(home, monkeypatch):
    from mlxspec.cpu import blas

    def dynamic_symbols(path: Path, which: str) -> set[str]:
        lines = subprocess.run(
            ["nm", "-D", which, str(path)], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        return {line.split()[-1].split("@")[0] for line in lines if line.strip()}

    libmlx = _mlx_cpu_libs().parent / "mlx" / "lib" / "libmlx.so"
    bundled = set()
    for library in _mlx_cpu_libs().glob("lib*blas*.so*"):
        bundled |= dynamic_symbols(library, "--defined-only")
    for library in _mlx_cpu_libs().glob("liblapack*.so*"):
        bundled |= dynamic_symbols(library, "--defined-only")
    imported = dynamic_symbols(libmlx, "--undefined-only") & bundled
    assert "cblas_sgemm" in imported

    monkeypatch.setenv("MLXSPEC_HOME", str(home))
    forwarded = dynamic_symbols(blas.shim_library(), "--defined-only")
    assert imported <= forwarded, f"not forwarded: {sorted(imported - forwarded)}"


# -- a whole model forward under both BLAS choices ----------------------------------------------------

TINY_LLAMA_LOGITS = r"""
import json
import mlxspec
import mlx.core as mx
from mlx_lm.models import llama

mx.random.seed(0)
args = llama.ModelArgs(model_type="llama", hidden_size=96, num_hidden_layers=2,
                       intermediate_size=256, num_attention_heads=6, num_key_value_heads=2,
                       rms_norm_eps=1e-5, vocab_size=512, tie_word_embeddings=True)
model = llama.Model(args)
model.set_dtype(mx.float32)
tokens = mx.array([[1, 17, 300, 42, 7, 99, 5, 256]])
logits = model(tokens)
print(json.dumps({"logits": logits.tolist(), "argmax": mx.argmax(logits, -1).tolist()}))
"""


def test_model_forward_matches_between_reference_and_openblas(home):
    reference = run_with_blas(TINY_LLAMA_LOGITS, "reference", home)
    optimized = run_with_blas(TINY_LLAMA_LOGITS, None, home)
    np.testing.assert_allclose(optimized["logits"], reference["logits"], rtol=1e-4, atol=1e-4)
    assert optimized["argmax"] == reference["argmax"]


GREEDY_TOKENS = r"""
import json
import mlxspec
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import dequantize_model

model, tokenizer = mlxspec.load(MODEL_DIR)
dequantize_model(model)
model.set_dtype(mx.float32)  # only float32 matmuls go through BLAS
prompt = mx.array(tokenizer.encode("The three primary colors are"))
tokens = [int(token) for token, _ in generate_step(prompt, model, max_tokens=8)]
print(json.dumps({"tokens": tokens}))
"""


@pytest.mark.slow
def test_greedy_tokens_of_real_model_equal_between_reference_and_openblas(smollm2_dir, home):
    code = GREEDY_TOKENS.replace("MODEL_DIR", repr(str(smollm2_dir)))
    reference = run_with_blas(code, "reference", home)
    optimized = run_with_blas(code, None, home)
    assert len(optimized["tokens"]) == 8
    assert optimized["tokens"] == reference["tokens"]


@pytest.mark.parametrize("busy, cores, threads", [(0.2, 2, 2), (0.7, 2, 1), (1.3, 2, 1),
                                                  (6.0, 2, 1), (2.4, 8, 6), (0.0, 1, 1)])
def test_default_threads_are_the_cores_left_free(monkeypatch, busy, cores, threads):
    from mlxspec.cpu import blas

    monkeypatch.setattr(blas, "busy_cores_elsewhere", lambda: busy)
    monkeypatch.setattr(blas.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert blas.default_threads() == threads


def test_refresh_threads_resizes_only_automatic_threads(monkeypatch):
    """``mlxspec.load`` sizes the threads again, once (the import's snapshot can catch the
    start-up of a pipe's other end); threads set by a thread variable stay as set."""
    from mlxspec.cpu import blas, blas_info

    if blas_info.blas_report(measure=False)["active"] != "openblas":
        pytest.skip("the optimized BLAS is not active in this process")
    import mlx.core as mx

    before = blas._shim.mlxspec_blas_threads()
    a, b = np.random.default_rng(0).standard_normal((2, 3, 256, 256)).astype(np.float32)
    try:
        monkeypatch.setattr(blas._state, "auto_threads", True)
        for threads in (2, 1):
            monkeypatch.setattr(blas, "default_threads", lambda threads=threads: threads)
            monkeypatch.setattr(blas._state, "refreshed", False)
            assert blas.refresh_threads() == threads
            assert f"{threads} thread{'s' * (threads > 1)};" in blas.skinny_products()
            product = np.array(mx.array(a[:, :4]) @ mx.array(b).transpose(0, 2, 1))
            np.testing.assert_allclose(product, a[:, :4] @ b.transpose(0, 2, 1), rtol=1e-4,
                                       atol=1e-3)
        monkeypatch.setattr(blas, "default_threads", lambda: 2)
        assert blas.refresh_threads() == 1  # once per process: a later load changes nothing
        monkeypatch.setattr(blas._state, "refreshed", False)
        monkeypatch.setattr(blas._state, "auto_threads", False)  # OPENBLAS_NUM_THREADS was set
        assert blas.refresh_threads() == 1
    finally:
        blas._set_openblas_threads(before)
        blas._shim.mlxspec_blas_set_threads(before)


def test_busy_cores_elsewhere_sees_another_busy_process_but_not_this_one():
    import threading

    from mlxspec.cpu import blas

    if not Path("/proc/loadavg").exists():
        pytest.skip("needs /proc (Linux)")

    def spin(seconds):
        end = time.time() + seconds
        while time.time() < end:
            pass

    def sample(n=20):  # a snapshot each: the median of a few says what runs steadily
        values = []
        for _ in range(n):
            values.append(blas.busy_cores_elsewhere())
            time.sleep(0.01)
        return sorted(values)[n // 2]

    # Whatever else runs on this machine comes and goes (a parallel test worker, a build), so
    # the baseline is taken again before each try; counting this process's own spinning thread
    # would add 1 in every try.
    tries = []
    for _ in range(3):
        baseline = sample()
        spinner = threading.Thread(target=spin, args=(0.6,))  # this process busy: not counted
        spinner.start()
        alone = sample()
        spinner.join()
        tries.append((alone, baseline))
        if alone < baseline + 1:
            break
    other = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                              "while time.time() - t < 3: pass\n"])
    try:
        time.sleep(0.5)  # past the interpreter's start-up
        with_other = sample()
    finally:
        other.kill()
        other.wait()
    assert any(alone < baseline + 1 for alone, baseline in tries), tries
    # The spinning child is runnable in every snapshot (running or waiting for a core); what
    # else was running at baseline may have stopped meanwhile, so it is not added here.
    assert with_other >= 1, (with_other, baseline)


def test_import_mlxspec_does_not_wait_to_size_the_threads():
    """The thread count comes from one snapshot (no sampling interval): cheap at import."""
    from mlxspec.cpu import blas

    start = time.perf_counter()
    for _ in range(10):
        blas.busy_cores_elsewhere()
    assert time.perf_counter() - start < 0.2  # was 10 x 50 ms


# -- the aligned copy of x: one buffer per thread, freed when the thread ends ---------------------

THREAD_BUFFERS = """
import ctypes, json, threading
import numpy as np
from mlxspec.cpu import blas
lib = ctypes.CDLL(str(blas.shim_library()))
lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [
    ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
    ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
m, n, k = 16, 64, 8192  # more rows than one kernel instance: x is copied to aligned rows
rng = np.random.default_rng(0)
raw = rng.standard_normal(m * k + 2, dtype=np.float32)
x = raw[2:].reshape(m, k)  # 8 bytes past numpy's 64-byte-aligned start: misaligned, as in MLX
w = rng.standard_normal((n, k), dtype=np.float32)
out = np.zeros((m, n), np.float32)
def product():
    lib.cblas_sgemm(101, 111, 112, m, n, k, 1.0, x.ctypes.data, k, w.ctypes.data, k, 0.0,
                    out.ctypes.data, n)
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
product()
before = rss_mb()
for _ in range(100):  # each thread's buffer is 512 KB: 50 MB if none is freed
    t = threading.Thread(target=product)
    t.start()
    t.join()
error = float(np.abs(out.astype(np.float64) - x.astype(np.float64) @ w.T.astype(np.float64)).max())
print(json.dumps({"grown_mb": rss_mb() - before, "error": error,
                  "mode": blas._shim.mlxspec_blas_skinny_mode()}))
"""


def test_a_thread_that_ends_frees_its_aligned_copy_of_x(home):
    out = run_with_blas(THREAD_BUFFERS, None, home)
    if out["mode"] & 3 != 3:
        pytest.skip("no skinny kernel on this CPU (needs AVX2 and FMA): x is never copied")
    assert out["error"] < 1e-2  # the products are still right (|x w| ~ 90 for k = 8192)
    assert out["grown_mb"] < 12, out
