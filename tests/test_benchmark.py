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


def test_dwq_local_runs_mlx_lm_dwq_and_lowers_its_loss_from_round_to_nearest(tmp_path):
    """bench/dwq_local.py (mlx-lm's DWQ loop on a local text, offline): its dense layers give the
    quantized layers' own outputs, and the model it writes loads in mlx-lm, records its training
    and is closer to the teacher on the training text (KL at DWQ's temperature 2) than mlx-lm's
    round-to-nearest start it was trained from."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import mlx.nn as nn
    import mlx_lm
    from mlx_lm.utils import load, quantize_model

    source = make_tiny_model(tmp_path / "m")
    text = tmp_path / "text.txt"
    text.write_text("The lighthouse keeper climbs the stairs at dusk and lights the lamp. " * 24)
    script = Path(__file__).parents[1] / "bench" / "dwq_local.py"
    patched = (
        "import runpy, sys, numpy as np, mlx.core as mx, mlx.nn as nn\n"
        f"dwq = runpy.run_path({str(script)!r})\n"
        "mx.random.seed(0)\n"
        "layer = nn.QuantizedLinear(128, 48, bias=True, group_size=32, bits=4)\n"
        "embed = nn.QuantizedEmbedding(40, 128, group_size=32, bits=4)\n"
        "x = mx.random.normal((3, 128))\n"
        "want = (layer(x), embed.as_linear(x))\n"
        "nn.QuantizedLinear.__call__ = nn.QuantizedEmbedding.as_linear = dwq['_dense']\n"
        "for got, w in zip((layer(x), embed.as_linear(x)), want):\n"
        "    np.testing.assert_allclose(np.array(got), np.array(w), rtol=1e-4, atol=1e-4)\n"
        "print('same')\n"
    )
    check = subprocess.run([sys.executable, "-c", patched], capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0 and check.stdout.strip() == "same", check.stderr
    out = tmp_path / "dwq"
    run = subprocess.run(
        [sys.executable, str(script), "--model", str(source), "--mlx-path", str(out), "--bits",
         "4", "--group-size", "32", "--text", str(text), "--max-seq-length", "65",
         "--epochs", "3", "--learning-rate", "1e-4"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((out / "dwq_local.json").read_text())
    windows = len(text.read_bytes()) // 65  # the byte tokenizer: a token per byte
    assert (record["windows"], record["steps"]) == (windows, (windows - 4) * 3 // 4)

    teacher, tokenizer = load(str(source))
    rtn, _, config = load(str(source), return_config=True)
    quantize_model(rtn, config, group_size=32, bits=4)
    trained, _ = mlx_lm.load(str(out))
    assert isinstance(trained.layers[0].mlp.up_proj, nn.QuantizedLinear)
    ids = mx.array([tokenizer.encode(text.read_text(), add_special_tokens=False)[:64]])

    def kl(student) -> float:  # mean KL(teacher || student) at temperature 2, as DWQ's loss
        p = mx.softmax(teacher(ids) / 2, axis=-1)
        log_q = student(ids) / 2
        log_q = log_q - mx.logsumexp(log_q, axis=-1, keepdims=True)
        return float((p * (mx.log(p) - log_q)).sum(-1).mean())

    assert kl(trained) < 0.6 * kl(rtn), (kl(trained), kl(rtn))  # 0.003 against 0.009
