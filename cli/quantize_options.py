"""How ``mlxspec quantize`` quantizes: bits, group size, method, format, dtype, mixed precision,
calibration and distillation. Spelled out here, without importing the library, so that
``mlxspec --help`` needs no mlx; tests/test_quantize_cli.py checks that the choices match the
library's METHODS and FORMATS."""

from __future__ import annotations

import click

METHODS = ("rtn", "gptq", "awq", "awq+gptq")
FORMATS = ("mlx", "zp")
DTYPES = ("float16", "bfloat16", "float32")

_OPTIONS = [
    click.option("--bits", "-b", default=4, show_default=True, type=int,
                 help="Bits per weight: 4 or 8 (2 and 3 also work, with a large quality loss)."),
    click.option("--group-size", "-g", default=64, show_default=True, type=int,
                 help="Weights sharing one scale and zero-point: 32, 64 or 128."),
    click.option("--method", default=None, type=click.Choice(METHODS),
                 help="awq+gptq (default; gptq with --act-order): activation-aware scales folded "
                      "into the norms, then GPTQ's error-feedback roundings, the most accurate; "
                      "gptq: error feedback only, faster; awq: the scales with weighted "
                      "round-to-nearest; rtn: round-to-nearest, no calibration text."),
    click.option("--format", "output_format", default="mlx", show_default=True,
                 type=click.Choice(FORMATS),
                 help="mlx: MLX affine layout, exact (scales and biases in --dtype encode "
                      "s*(q - z) bit for bit), loaded by mlx-lm, LM Studio and every MLX tool; zp: "
                      "mlxspec zero-point layout, only for what cannot be exact (--act-order)."),
    click.option("--dtype", default=None, type=click.Choice(DTYPES),
                 help="dtype of scales, biases and unquantized parameters (so of activations and "
                      "KV cache); default the source's. A GGUF source converts to float32, or to "
                      "float16 for a llama on Metal (MLXSPEC_GGUF_DTYPE overrides): pass "
                      "float16 or bfloat16 for a half-precision model."),
    click.option("--mixed", "recipe", default=None,
                 help="Mixed precision: a recipe (JSON file, or a shipped one: embed8, mixed8, "
                      "float-head), or auto[:BPW] to measure each kind of layer's sensitivity and "
                      "give 8 bits to the most sensitive within BPW bits per weight (default: "
                      "bits + 0.5)."),
    click.option("--group-fallback", is_flag=True,
                 help="Layers whose input size the group size does not divide use the largest "
                      "group size that does (e.g. 64 for SmolLM2's 576) instead of an error."),
    click.option("--act-order", is_flag=True,
                 help="GPTQ: quantize columns by decreasing activation (zp format only)."),
    click.option("--calibration", type=click.Path(dir_okay=False), default=None,
                 help="Calibration text for the calibrated methods (UTF-8; default: the built-in "
                      "public-domain text)."),
    click.option("--calibration-windows", "n_windows", default=None, type=click.IntRange(min=1),
                 help="Calibrated methods: number of calibration windows (with much less text "
                      "than the default, awq beats awq+gptq)  [default: 32]"),
    click.option("--calibration-tokens", "window_tokens", default=None, type=click.IntRange(min=8),
                 help="Calibrated methods: tokens per calibration window  [default: 256]"),
    click.option("--distill-epochs", default=0, show_default=True, type=click.IntRange(min=0),
                 help="Then tune the scales by distillation from the source on the calibration "
                      "text, this many passes (8 is a good choice; the most accurate result, "
                      "~30 min for SmolLM2-135M on a 2-core CPU). Kept only if held-out KL drops."),
]


def method_options(f):
    """The options above, in this order, on the command ``f``."""
    for option in reversed(_OPTIONS):
        f = option(f)
    return f
