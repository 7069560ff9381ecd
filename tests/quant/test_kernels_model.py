"""A real (tiny) model through the Metal path, its kernels emulated (``MLXSPEC_KERNELS=emulate``):
the product's own dispatch, grid and threadgroup choice and reshapes, with every kernel launch run
by the CPU emulator (``mlxspec.metal.emulator``), against the same model on the fallback path.

Logic only: passing here says the Metal path computes the right numbers, not how fast. Float32
scales are the quantizer's output for float32 models (the default model, every GGUF import): the
kernels once refused them, so the first forward on a Mac raised.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from llama_toys import tiny_llama
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import make_tiny_model

from mlxspec.cpu import quantized as cpu_quantized
from mlxspec.metal import emulator
from mlxspec.quant import kernels, layers
from mlxspec.quant.quantize import quantize_model

pytestmark = pytest.mark.skipif(emulator.unavailable() is not None,
                                reason=str(emulator.unavailable()))
PROMPT = [[3, 17, 42, 8, 25, 61]]  # six tokens: a verification-sized block (zp_qmm at BM = 8)
# Largest logit error relative to the largest logit: float32 accumulation in every path, then the
# activations rounded to the model's dtype between layers (two layers).
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}


@pytest.fixture(autouse=True)
def macs_fallback(monkeypatch):
    """The fallback a Mac has: MLX's own ``mx.quantized_matmul``, not the Linux CPU backend's
    packed kernel (its int8 activations are another approximation, measured on its own)."""
    monkeypatch.setenv(cpu_quantized.SWITCH, "0")


def forward(model, path: str, monkeypatch) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Logits of the prompt (6 rows at once) and of one decoded token after it (1 row), on
    ``path`` ("mlx": the fallback; "emulate": the Metal path, kernels emulated), and the kernels
    launched."""
    monkeypatch.setenv("MLXSPEC_KERNELS", path)
    monkeypatch.setenv("MLXSPEC_QMM", "zp")  # 2-16 rows on zp_qmm (no timings on this machine)
    for layer in layers.zero_point_modules(model).values():
        layer.drop_derived()  # each layer chooses its path on first use
    launched = []
    run_kernel = kernels._emulated

    def recording(name, launch):
        launched.append(name)
        return run_kernel(name, launch)

    monkeypatch.setattr(kernels, "_emulated", recording)
    cache = make_prompt_cache(model)
    prompt = model(mx.array(PROMPT), cache=cache)
    decode = model(mx.argmax(prompt[:, -1:], axis=-1), cache=cache)
    mx.eval(prompt, decode)
    as_numpy = [np.array(a.astype(mx.float32)) for a in (prompt, decode)]
    monkeypatch.setattr(kernels, "_emulated", run_kernel)
    return *as_numpy, launched


@pytest.mark.parametrize("bits,dtype", [(4, "float32"), (8, "float32"), (8, "float16"),
                                        (4, "bfloat16")])
def test_a_model_through_the_emulated_metal_path_matches_the_fallback(bits, dtype, monkeypatch):
    model = tiny_llama(seed=bits, vocab=96)
    quantize_model(model, bits=bits, group_size=32, dtype=dtype)
    layer = model.model.layers[0].mlp.up_proj
    assert isinstance(layer, layers.ZeroPointLinear) and layer.scales.dtype == getattr(mx, dtype)
    want_prompt, want_decode, launched = forward(model, "mlx", monkeypatch)
    assert launched == []
    got_prompt, got_decode, launched = forward(model, "emulate", monkeypatch)
    # 7 projections per layer and the head, once for the prompt (zp_qmm) and once for the token
    assert launched == ["zp_qmm"] * 15 + ["zp_qmv"] * 15
    for got, want in ((got_prompt, want_prompt), (got_decode, want_decode)):
        assert got.shape == want.shape
        error = np.abs(got - want).max() / np.abs(want).max()
        assert error < TOLERANCE[dtype], f"{dtype}: logits off by {error:.2e} of their range"
    assert (got_prompt.argmax(-1) == want_prompt.argmax(-1)).mean() >= 5 / 6


def test_verification_rows_past_16_take_quantized_matmul_on_the_metal_path(monkeypatch):
    model = tiny_llama(seed=1, vocab=96)
    quantize_model(model, bits=4, group_size=32, dtype="float32")
    monkeypatch.setenv("MLXSPEC_KERNELS", "emulate")
    monkeypatch.setenv("MLXSPEC_QMM", "zp")
    assert [kernels.route(m, 4, 32) for m in (1, 16, 17)] == ["zp_qmv", "zp_qmm", "affine"]
    rows = mx.array([[(7 * i) % 96 for i in range(17)]])
    with_kernels = model(rows)
    monkeypatch.setenv("MLXSPEC_KERNELS", "mlx")
    for layer in layers.zero_point_modules(model).values():
        layer.drop_derived()
    want = model(rows)
    assert np.abs(np.array(with_kernels) - np.array(want)).max() < 1e-4 * np.abs(want).max()


@pytest.fixture(scope="module")
def zp_model_dir(tmp_path_factory):
    """A tiny llama with the byte tokenizer, quantized to the zero-point format (4-bit, float32
    scales: the model's dtype) and saved as a model directory."""
    from mlx_lm.utils import load_model

    from mlxspec.quant.storage import save_quantized

    source = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)
    model, config = load_model(source)
    _, quantization = quantize_model(model, bits=4, group_size=32)
    return save_quantized(model, tmp_path_factory.mktemp("zp") / "tiny-zp", config=config,
                          quantization=quantization, source_dir=source, output_format="zp")


def test_emulated_generate_gives_the_fallbacks_greedy_text(zp_model_dir, monkeypatch):
    from mlxspec.cli.main import cli

    texts, launched = {}, []
    run_kernel = kernels._emulated
    monkeypatch.setattr(kernels, "_emulated", lambda name, launch: (
        launched.append(name), run_kernel(name, launch))[1])
    for path in ("mlx", "emulate"):
        monkeypatch.setenv("MLXSPEC_KERNELS", path)
        result = CliRunner().invoke(cli, ["generate", "-m", str(zp_model_dir), "-p", "hello",
                                          "--no-chat-template", "--temp", "0", "--max-tokens",
                                          "8", "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout[result.stdout.index("{"):])
        texts[path] = report["text"]
        assert bool(launched) == (path == "emulate")  # the fallback launches no kernel
        assert (report.get("kernels") == kernels.EMULATED) == (path == "emulate")  # says so
    assert texts["emulate"] == texts["mlx"] and len(texts["mlx"]) > 0
    assert "zp_qmv" in launched  # decoding went through the decode kernel
