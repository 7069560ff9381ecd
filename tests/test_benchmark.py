"""mlxspec.benchmark's measurement helpers, against independent counts (the files on disk)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny_models import make_tiny_model

from mlxspec import benchmark


@pytest.mark.parametrize("tied", [True, False])
def test_model_bytes_is_what_one_token_reads(tmp_path, tied):
    from mlxspec.load import load

    model_dir = make_tiny_model(tmp_path / "m", tie_word_embeddings=tied)
    model, _ = load(str(model_dir))
    stored = {k: v for f in model_dir.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    total = sum(v.nbytes for v in stored.values())
    embedding = sum(v.nbytes for k, v in stored.items() if "embed_tokens" in k)
    # tied: the table is the output head and is read whole; untied: one row per token
    assert benchmark.model_bytes(model) == (total if tied else total - embedding)


def test_bandwidth_and_roofline_arithmetic():
    assert benchmark.achieved_bandwidth(2_000_000_000, 5.0) == pytest.approx(10.0)
    assert benchmark.roofline(10.0, 40.0) == pytest.approx(0.25)


def test_measured_bandwidths_are_plausible():
    copy, read = benchmark.memory_bandwidth(megabytes=32, repeats=2), benchmark.read_bandwidth(
        megabytes=32, repeats=2)
    assert 0.05 < copy < 2000 and 0.05 < read < 2000  # GB/s: any machine, loaded or not


def test_anchor_runs_dense_quantized_linear_is_quantized_matmul():
    """bench/quantized.py runs mlx_lm.quant.awq with nn.QuantizedLinear computed densely (its CPU
    quantized_matmul has no BLAS); the patched layer must give the layer's own outputs."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "quantized.py"
    spec = importlib.util.spec_from_file_location("bench_quantized", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    check = (
        "import numpy as np\n"
        "assert nn.QuantizedLinear.__call__.__name__ == '_dense_call'\n"
        "mx.random.seed(0)\n"
        "for bias in (False, True):\n"
        "    layer = nn.QuantizedLinear(128, 48, bias=bias, group_size=32, bits=4)\n"
        "    if bias:\n"
        "        layer.bias = mx.random.normal((48,))\n"
        "    x = mx.random.normal((3, 5, 128))\n"
        "    y = layer(x)\n"
        "    want = mx.quantized_matmul(x, layer.weight, layer.scales, layer.biases, True, 32, 4)\n"
        "    want = want + layer.bias if bias else want\n"
        "    assert y.shape == (3, 5, 48)\n"
        "    np.testing.assert_allclose(np.array(y), np.array(want), rtol=1e-4, atol=1e-4)\n"
        "print('same')\n"
    )
    result = subprocess.run([sys.executable, "-c", bench._DENSE_QUANTIZED_LINEAR + check],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "same"
