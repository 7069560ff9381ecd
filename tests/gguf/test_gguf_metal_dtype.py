"""The dtype of a GGUF import (issue 45, finding 6): on Metal a llama converts to float16 from end
to end (matrices, imported scales, norms), so its activations stay float16 and MLX's quantized
products meet the GGUF's own float16 scales; on a CPU everything stays float32. Metal is
simulated for the conversion only (``mx.metal.is_available``); the result is loaded and run on
the CPU against the float32 conversion of the same file."""

from __future__ import annotations

import mlx.core as mx
import mlx.utils
import pytest
from gguf import GGMLQuantizationType as Q
from tiny_models import write_tiny_gguf

from mlxspec.errors import UnsupportedModelError
from mlxspec.gguf import convert
from mlxspec.gguf.convert import convert_gguf, gguf_cache_key
from mlxspec.gguf.dtype import DTYPE_ENV, conversion_dtype
from mlxspec.load import load

TYPES = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0,
         "attn_output": Q.Q5_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_1}


@pytest.fixture
def on_metal(monkeypatch):
    monkeypatch.delenv(DTYPE_ENV, raising=False)
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    return monkeypatch


def test_the_dtype_is_float16_for_llama_on_metal_and_float32_elsewhere(on_metal):
    assert conversion_dtype("llama") == "float16"
    assert conversion_dtype("gemma3") == "float32"  # float16 loses Gemma's residual stream
    on_metal.setattr(mx.metal, "is_available", lambda: False)
    assert conversion_dtype("llama") == conversion_dtype("gemma3") == "float32"
    on_metal.setenv(DTYPE_ENV, "bfloat16")
    assert conversion_dtype("llama") == "bfloat16"
    on_metal.setenv(DTYPE_ENV, "float64")
    with pytest.raises(UnsupportedModelError, match=DTYPE_ENV):
        conversion_dtype("llama")


def test_a_metal_and_a_cpu_conversion_are_cached_apart(tmp_path, on_metal):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    on_metal.setenv(convert.gguf_quant.MODE_ENV, "quantized")  # the same mode on both
    metal_key = gguf_cache_key(path)
    on_metal.setattr(mx.metal, "is_available", lambda: False)
    assert gguf_cache_key(path) != metal_key


def test_a_llama_converted_for_metal_runs_in_float16_close_to_float32(tmp_path, on_metal):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", types=TYPES)
    half_dir = convert_gguf(path, tmp_path / "metal", progress=False)  # Metal: quantized, float16
    on_metal.setenv(convert.gguf_quant.MODE_ENV, "quantized")
    full_dir = convert_gguf(path, tmp_path / "float32", dtype="float32", progress=False)
    on_metal.setattr(mx.metal, "is_available", lambda: False)
    half, tokenizer = load(str(half_dir))
    full, _ = load(str(full_dir))
    floats = {name: w for name, w in mlx.utils.tree_flatten(half.parameters())
              if mx.issubdtype(w.dtype, mx.floating)}
    assert {w.dtype for w in floats.values()} == {mx.float16}  # norms and scales too
    assert any(name.endswith("scales") for name in floats)  # the GGUF blocks stayed quantized
    # The same numbers as the float32 conversion, rounded to float16 (the GGUF's own float16
    # scales exactly).
    for name, w in mlx.utils.tree_flatten(full.parameters()):
        assert mx.array_equal(w.astype(half_weight(floats, name, w).dtype),
                              half_weight(floats, name, w)), name
    tokens = mx.array([tokenizer.encode("hello there, hello!")])
    got, want = half(tokens), full(tokens)
    assert got.dtype == mx.float16 and want.dtype == mx.float32  # the activations follow
    error = mx.abs(got.astype(mx.float32) - want).max() / mx.abs(want).max()
    assert 0 < error.item() < 0.15, error  # a random 2-layer model: float16 rounding only


def half_weight(floats: dict, name: str, w: mx.array) -> mx.array:
    return floats.get(name, w)  # integer arrays (packed codes, zero-points) are not floats


def test_doctor_compares_the_metal_dtype_with_float32_and_flags_float32_activations(
        tmp_path, on_metal):
    """``doctor --kernels``' line for finding 6, run here on the CPU (quality only): the model
    converted for Metal computes in float16, agrees with float32; a float32 embedding (what
    the zero-point twin of a Q8_0 table returned before) is reported, not passed."""
    from mlxspec.quant.layers import ZeroPointEmbedding
    from mlxspec.system import model_dtype_check

    path = write_tiny_gguf(tmp_path / "tiny.gguf", types=TYPES)
    model_dir = convert_gguf(path, tmp_path / "metal", progress=False)
    on_metal.setattr(mx.metal, "is_available", lambda: False)
    report = model_dtype_check(*load(str(model_dir)), tokens=4)
    assert report["ok"] and report["activations"] == "float16", report
    assert report["greedy_tokens_equal_to_float32"] == "4/4"
    assert 0 < report["prompt_logits_max_rel_error"] < 1e-2 and "CPU" in report["note"]
    model, tokenizer = load(str(model_dir))
    assert isinstance(model.model.embed_tokens, ZeroPointEmbedding)  # Q8_0: z = 128
    rows = ZeroPointEmbedding.__call__
    on_metal.setattr(ZeroPointEmbedding, "__call__",
                     lambda self, ids: rows(self, ids).astype(mx.float32))
    report = model_dtype_check(model, tokenizer, tokens=4)
    assert not report["ok"] and report["activations"] == "float32"
