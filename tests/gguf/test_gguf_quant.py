"""GGUF blocks imported as MLX quantized weights: bit-exact against llama.cpp's own dequantization
(gguf-py's reference implementation) on real tensors of both test models, and the per-device
choice between dense and quantized conversion."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

from mlxspec import cpu
from mlxspec.errors import UnsupportedModelError
from mlxspec.gguf import tensors as gguf_quant
from mlxspec.gguf.convert import convert_gguf, gguf_cache_key, read_gguf
from mlxspec.load import default_model_path


def assert_mlx_dequantizes_to_the_gguf_reference(qtype, raw, shape, reference):
    arrays = gguf_quant.affine_arrays(qtype, raw, shape)
    half = np.float32 if qtype == Q.Q4_K else np.float16
    assert arrays["scales"].dtype == arrays["biases"].dtype == half
    bits = gguf_quant.IMPORTED[qtype]
    # float32 arithmetic, as llama.cpp's dequantization and MLX's matmuls with float32 inputs
    got = mx.dequantize(mx.array(arrays["weight"]), mx.array(arrays["scales"]).astype(mx.float32),
                        mx.array(arrays["biases"]).astype(mx.float32), group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(got), reference.reshape(shape))


def test_real_q4_1_and_q8_0_tensors_of_smollm2_import_bit_exact():
    gguf = read_gguf(default_model_path())
    for name in ("blk.0.attn_q.weight", "blk.29.ffn_down.weight", "token_embd.weight"):
        t = gguf.tensors[name]
        assert t.qtype in (Q.Q4_1, Q.Q8_0)
        rows = slice(0, 2048)  # the embedding's first rows are enough
        assert_mlx_dequantizes_to_the_gguf_reference(
            t.qtype, t.raw[rows], (min(t.shape[0], 2048), t.shape[1]), t.dequantize()[rows])


@pytest.mark.slow
def test_real_q5_0_q8_0_and_q4_k_tensors_of_gemma3_import_bit_exact(gemma3_gguf):
    gguf = read_gguf(gemma3_gguf)
    seen = set()
    for t in gguf.tensors.values():
        if t.qtype in (Q.Q5_0, Q.Q8_0, Q.Q4_K) and t.qtype not in seen and len(t.shape) == 2:
            seen.add(t.qtype)
            rows = slice(0, 1024)
            assert_mlx_dequantizes_to_the_gguf_reference(
                t.qtype, t.raw[rows], (min(t.shape[0], 1024), t.shape[1]), t.dequantize()[rows])
    assert seen == {Q.Q5_0, Q.Q8_0, Q.Q4_K}


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0])
def test_every_imported_block_type_is_bit_exact_on_heavy_tailed_weights(qtype):
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_t(3, (24, 256)) * 0.03).astype(np.float32)
    raw = gguf_quantize(w, qtype)
    from gguf.quants import dequantize

    assert_mlx_dequantizes_to_the_gguf_reference(qtype, raw, w.shape, dequantize(raw, qtype))


def test_k_quants_have_no_exact_layout():
    with pytest.raises(UnsupportedModelError, match="Q6_K"):
        gguf_quant.affine_arrays(Q.Q6_K, np.zeros((1, 210), np.uint8), (1, 256))


def test_the_import_mode_follows_the_device_and_the_override(monkeypatch):
    monkeypatch.delenv(gguf_quant.MODE_ENV, raising=False)
    # quantized on Metal, and on a CPU where the packed kernel measured faster than float32
    packed = mx.metal.is_available() or cpu.packed_weights_pay()[0]
    assert gguf_quant.import_mode() == ("quantized" if packed else "dense")
    assert "dequantized" in gguf_quant.describe()
    if packed:  # the kinds kept packed are those the device multiplies packed
        assert ("Q5_0" in gguf_quant.describe()) == (5 in gguf_quant.packed_bits())
    if not mx.metal.is_available() and cpu.quantized_products():
        assert "measured here" in gguf_quant.describe()
    path = default_model_path()
    keys = set()
    for mode in ("dense", "quantized"):
        monkeypatch.setenv(gguf_quant.MODE_ENV, mode)
        assert gguf_quant.import_mode() == mode and mode in gguf_quant.describe()
        keys.add(gguf_cache_key(path))
    assert len(keys) == 2  # a dense conversion is never reused as a quantized one
    # a forced quantized import keeps every type packed, whatever the CPU kernel multiplies
    assert gguf_quant.packed_bits() == (4, 5, 8)
    with gguf_quant.dense_conversion():  # quantize needs a float source on every device
        assert gguf_quant.import_mode() == "dense"
    assert gguf_quant.import_mode() == "quantized"
    monkeypatch.setenv(gguf_quant.MODE_ENV, "fast")
    with pytest.raises(UnsupportedModelError, match="auto, dense or quantized"):
        gguf_quant.import_mode()


def test_quantized_smollm2_conversion_runs_close_to_the_dense_one(smollm2, tmp_path, monkeypatch):
    from mlxspec.load import load
    from mlxspec.quant import layers

    monkeypatch.setenv(gguf_quant.MODE_ENV, "quantized")
    out = convert_gguf(default_model_path(), tmp_path / "q", progress=False)
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    assert quantization["bits"] == 4 and quantization["group_size"] == 32
    assert quantization["model.embed_tokens"]["bits"] == 8 and quantization["dequantized"] == []
    weights = mx.load(str(out / "model.safetensors"))
    # float32 scales on the embedding table only: plain mlx-lm computes in the scales' dtype
    assert weights["model.embed_tokens.scales"].dtype == mx.float32
    assert weights["model.layers.0.mlp.up_proj.scales"].dtype == mx.float16
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert size < 1.1 * default_model_path().stat().st_size  # the GGUF's bytes, not float32's
    model, tokenizer = load(str(out))
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"  # Q4_1: float min
    assert isinstance(model.model.embed_tokens, layers.ZeroPointEmbedding)  # Q8_0: z = 128
    dense, _ = smollm2
    x = mx.array([tokenizer.encode("The capital of France is")])
    got, want = model(x), dense(x)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-2 * np.abs(want).max().item())
    assert mx.array_equal(got[0].argmax(-1), want[0].argmax(-1)).item()


@pytest.mark.slow
def test_gemma3_keeps_packed_only_the_widths_this_device_multiplies_packed(gemma3, gemma3_gguf):
    from mlxspec.load import resolve_model_path

    model, _ = gemma3
    kept = gguf_quant.packed_bits() if gguf_quant.import_mode() == "quantized" else ()
    widths = {m.bits for _, m in model.named_modules() if hasattr(m, "scales")}
    # Q4_K (4 bits) and Q8_0 (8) stay packed where kept; Q5_0 only where 5 bits are multiplied
    # packed (Metal), else it is a float32 copy, as is every Q6_K
    assert widths == {4, 5, 8} & set(kept)
    config = json.loads((resolve_model_path(str(gemma3_gguf)) / "config.json").read_text())
    if kept:
        assert ("Q5_0" in config["quantization"]["dequantized"]) == (5 not in kept)
