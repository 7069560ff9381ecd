"""The default output of quantization on the real models: MLX's affine layout, exact in the
model's dtype, so plain mlx-lm runs the very weights mlxspec computes with.

The checks, run on one calibrated quantization per model, each in a file of its own so the two
test workers share them: SmolLM2-135M with GPTQ in float16 (``test_quant_storage.py``) and
Gemma-3-270M with AWQ in bfloat16 (``test_quant_storage_gemma3.py``); both sources are float32
after GGUF conversion. Each is saved once and checked against mlx-lm's own loader, dequantizer and
generator.

mlx-lm on this CPU runs ``mx.quantized_matmul``, which accumulates half-precision products in half
precision; mlxspec's default CPU path multiplies an exact float32 copy (the correctly rounded
result). The logits comparison therefore runs mlxspec with ``MLXSPEC_ZP_CPU=quantized`` -- the
same kernel on the same tensors -- where any difference in the weights or the layer's dtypes shows
up as different bits.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from mlxspec.load import build_model, read_config
from mlxspec.quant import layers, zp_format
from mlxspec.quant.calibrate import calibration_windows
from mlxspec.quant.quantize import quantize_model
from mlxspec.quant.storage import mlx_lm_loadable, save_quantized

PROMPT = "Paris"  # short: MLX's CPU half-precision quantized matmul takes ~7 s a SmolLM2 row


def quantize_and_save(source: Path, out: Path, method: str, dtype: str, tokenizer) -> dict:
    """Quantize ``source`` (4 bits, g64) in ``dtype``; save it; return the in-memory layers'
    packed integers, zero points and scales per path (``s * (q - z)`` is formed by the check).
    ``tokenizer``: the source's (a session fixture's: Gemma-3's takes ~5 s to load)."""
    model, _ = build_model(source)
    calibration, _ = calibration_windows(tokenizer, windows=4, window_tokens=64)
    # grid=1: min-max rounding after the calibrated step (the clip search only costs time here)
    _, record = quantize_model(model, bits=4, group_size=64, method=method, dtype=dtype, grid=1,
                               calibration_tokens=calibration, group_fallback=True)
    reference = {path: (layer.weight, layer.zeros, layer.scales, layer.bits, layer.in_features,
                        layer.group_size)
                 for path, layer in layers.zero_point_modules(model).items()}
    save_quantized(model, out, config=read_config(source), quantization=record,
                   source_dir=source)
    return {"dir": out, "dtype": getattr(mx, dtype), "reference": reference, "source": source,
            "dtype_name": dtype, "prompt": tokenizer.encode(PROMPT)}


def s_times_q_minus_z(weight, zeros, scales, bits: int, cols: int, group_size: int) -> mx.array:
    """The layer's weights (N, cols) float32 from its packed integers q, zero points z and scales
    s. Exact in float32: a half-precision s (at most 11 significant bits) times an integer
    |q - z| < 2**bits needs at most 19, so these are the float64 products."""
    assert scales.dtype in (mx.float16, mx.bfloat16)
    q = zp_format.unpack(weight, bits, cols).astype(mx.float32)
    z = zp_format.unpack(zeros, bits, cols // group_size).astype(mx.float32)
    n = q.shape[0]
    groups = q.reshape(n, -1, group_size) - z[:, :, None]
    return (scales.astype(mx.float32)[:, :, None] * groups).reshape(n, cols)


def check_mlx_lm_dequantizes_every_weight_to_s_times_q_minus_z(saved: dict) -> None:
    # mlx-lm's own weight loader (mlx_lm.load without the tokenizer, seconds on Gemma-3's).
    model, _ = load_model(saved["dir"])
    affine = {p: m for p, m in model.named_modules() if hasattr(m, "biases")}
    assert set(affine) == set(saved["reference"])
    for path, m in affine.items():
        assert m.scales.dtype == m.biases.dtype == saved["dtype"], path
        got = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
        want = s_times_q_minus_z(*saved["reference"][path]).astype(saved["dtype"])
        assert mx.array_equal(got, want).item(), path
    config = json.loads((saved["dir"] / "config.json").read_text())
    assert mlx_lm_loadable(config)[0] and config["quantization"]["format"] == "mlx"
    # Every stored float (norms, scales, biases) is in the chosen dtype: mlx-lm's bits per weight.
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {saved["dtype"], mx.uint32}


def check_mlx_lm_computes_mlxspec_logits_bit_for_bit(saved: dict, monkeypatch) -> None:
    """Plain mlx-lm's forward pass and mlxspec's, each loading the saved directory its own way,
    give the same logits bit for bit (so the same text under any decoding): one forward each,
    since MLX's half-precision CPU quantized matmul takes seconds a pass."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxspec.cache import make_cache

    model, _ = load_model(saved["dir"])  # mlx_lm.load's model, without its tokenizer
    ids = mx.array(saved["prompt"])[None]
    cache = make_prompt_cache(model)
    theirs = model(ids, cache=cache)
    mx.eval(theirs)
    assert cache[0].keys.dtype == saved["dtype"]  # activations and KV cache stay half precision
    monkeypatch.setenv(layers.CPU_PATH_ENV, "quantized")
    ours_model, _ = build_model(saved["dir"])  # mlxspec's loader; the tokenizer is not needed
    assert layers.zero_point_modules(ours_model)  # mlxspec runs its own layers on the weights
    ours = ours_model(ids, cache=make_cache(ours_model))
    assert ours.dtype == theirs.dtype == saved["dtype"]
    assert mx.array_equal(ours, theirs).item()
    assert mx.all(mx.isfinite(ours.astype(mx.float32))).item()


def check_calibrated_beats_round_to_nearest(saved: dict, float_model: tuple,
                                           window_tokens: int = 160) -> None:
    """``float_model``: the float32 source (model, tokenizer); one held-out window of
    ``window_tokens``."""
    # Same bits, group size, dtype and layout (so the same bits per weight); held-out text.
    from mlxspec.evaluation import builtin_windows, compare

    reference, tokenizer = float_model
    windows = builtin_windows(tokenizer, windows=1, window_tokens=window_tokens)
    calibrated, _ = build_model(saved["dir"])  # the weights only: no tokenizer needed here
    rtn_model, _ = build_model(saved["source"])
    # grid=1 as the calibrated model was quantized: the same min-max rule, only calibration differs
    quantize_model(rtn_model, bits=4, group_size=64, method="rtn", dtype=saved["dtype_name"],
                   grid=1, group_fallback=True)
    ours, rtn = compare(calibrated, reference, windows), compare(rtn_model, reference, windows)
    assert ours["kl_mean"] < 0.9 * rtn["kl_mean"], (ours, rtn)
    assert ours["top1_agreement"] >= rtn["top1_agreement"] - 3  # 1 token: 100 / (window_tokens - 1)
