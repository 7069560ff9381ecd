"""`mlxspec quantize`: quantize a model to 4 or 8 bits, save it, gate it (and upload it).

A thin shell over :func:`mlxspec.quantize_flow.quantize_to_dir`, which checks every input
before the slow work and owns the flow.
"""

from __future__ import annotations

import click

from mlxspec.cli.common import gate_options

# Spelled out here so that `mlxspec --help` needs no mlx; tests/test_quantize_cli.py checks that
# they match the library's METHODS and FORMATS.
METHODS = ("rtn", "gptq", "awq", "awq+gptq")
FORMATS = ("mlx", "zp")
DTYPES = ("float16", "bfloat16", "float32")


@click.command("quantize")
@click.argument("model", required=False)
@click.option("--out", "-o", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to write (created atomically; never the source or above it).")
@click.option("--bits", "-b", default=4, show_default=True, type=int,
              help="Bits per weight: 4 or 8 (2 and 3 also work, with a large quality loss).")
@click.option("--group-size", "-g", default=64, show_default=True, type=int,
              help="Weights sharing one scale and zero-point: 32, 64 or 128.")
@click.option("--method", default=None, type=click.Choice(METHODS),
              help="awq+gptq (default; gptq with --act-order): activation-aware scales folded "
                   "into the norms, then GPTQ's error-feedback roundings, the most accurate; "
                   "gptq: error feedback only, faster; awq: the scales with weighted "
                   "round-to-nearest; rtn: round-to-nearest, no calibration text.")
@click.option("--format", "output_format", default="mlx", show_default=True,
              type=click.Choice(FORMATS),
              help="mlx: MLX affine layout, exact (scales and biases in --dtype encode "
                   "s*(q - z) bit for bit), loaded by mlx-lm, LM Studio and every MLX tool; zp: "
                   "mlxspec zero-point layout, only for what cannot be exact (--act-order).")
@click.option("--dtype", default=None, type=click.Choice(DTYPES),
              help="dtype of scales, biases and unquantized parameters (so of activations and "
                   "KV cache); default the source's. GGUF sources convert to float32: pass "
                   "float16 or bfloat16 for a half-precision model.")
@click.option("--mixed", "recipe", default=None,
              help="Mixed precision: a recipe (JSON file, or a shipped one: embed8, mixed8, "
                   "float-head), or auto[:BPW] to measure each kind of layer's sensitivity and "
                   "give 8 bits to the most sensitive within BPW bits per weight (default: "
                   "bits + 0.5).")
@click.option("--group-fallback", is_flag=True,
              help="Layers whose input size the group size does not divide use the largest "
                   "group size that does (e.g. 64 for SmolLM2's 576) instead of an error.")
@click.option("--act-order", is_flag=True,
              help="GPTQ: quantize columns by decreasing activation (zp format only).")
@click.option("--calibration", type=click.Path(dir_okay=False), default=None,
              help="Calibration text for the calibrated methods (UTF-8; default: the built-in "
                   "public-domain text).")
@click.option("--calibration-windows", "n_windows", default=None, type=click.IntRange(min=1),
              help="Calibrated methods: number of calibration windows (with much less text "
                   "than the default, awq beats awq+gptq)  [default: 32]")
@click.option("--calibration-tokens", "window_tokens", default=None, type=click.IntRange(min=8),
              help="Calibrated methods: tokens per calibration window  [default: 256]")
@click.option("--distill-epochs", default=0, show_default=True, type=click.IntRange(min=0),
              help="Then tune the scales by distillation from the source on the calibration "
                   "text, this many passes (8 is a good choice; the most accurate result, "
                   "~30 min for SmolLM2-135M on a 2-core CPU). Kept only if held-out KL drops.")
@click.option("--force", is_flag=True,
              help="Replace --out if it is a model directory mlxspec wrote (or empty).")
@click.option("--no-eval", is_flag=True,
              help="Skip the quality gate (evaluation against the source model).")
@click.option("--reference", "-r", default=None,
              help="Gate against this model instead of the source (same tokenizer).")
@gate_options
@click.option("--upload-repo", default=None,
              help="Then upload the result to this Hub repo ('user/name') with a model card.")
@click.option("--private", is_flag=True, help="With --upload-repo: create the repo private.")
@click.option("--force-upload", is_flag=True,
              help="With --upload-repo: upload even without passing evaluation results.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON at the end.")
def command(model, out_dir, bits, group_size, method, output_format, dtype, recipe, group_fallback,
            act_order, calibration, n_windows, window_tokens, distill_epochs, force, no_eval, reference,
            max_kl, min_top1, upload_repo, private, force_upload, as_json):
    """Quantize MODEL's weights to BITS bits with a per-group scale and zero-point, and save it.

    MODEL is a Hub repo id, a model directory or a .gguf file (default: the embedded model). The
    output directory holds the weights, config.json (with a "quantization" record: method, bits,
    group size, format, mlxspec version, calibration text hash, source model), the tokenizer and
    the chat template. Then the quality gate compares it with the source on held-out text and
    stores the verdict beside it (mlxspec_eval.json).

    \b
    Examples:
      mlxspec quantize --out smollm2-q4                     # 4-bit AWQ+GPTQ, group size 64
      mlxspec quantize --out smollm2-q4 --mixed embed8      # head and embeddings at 8 bits
      mlxspec quantize --out smollm2-q8 --bits 8 --method rtn
      mlxspec quantize --out smollm2-gptq --method gptq     # GPTQ alone: faster
      mlxspec quantize --out smollm2-q4d --distill-epochs 8  # then distil the scales: best
      mlxspec quantize model.gguf --out q4 --dtype bfloat16   # half-precision scales
      mlxspec quantize --out q4-act --act-order --format zp  # act-order: zero-point layout
      mlxspec quantize --out q4 -g 128 --group-fallback     # g128 where the width allows
      mlxspec quantize --out smollm2-q4 --upload-repo me/smollm2-q4   # gate, then upload
    """
    from mlxspec.cli import render
    from mlxspec.quantize_flow import quantize_to_dir

    def on_step(step, report):
        if not as_json:
            click.echo(render.quantize_step(step, report))

    report = quantize_to_dir(
        model, out_dir, bits=bits, group_size=group_size, method=method,
        output_format=output_format, dtype=dtype, recipe=recipe, group_fallback=group_fallback,
        act_order=act_order, calibration=calibration, calibration_windows=n_windows,
        calibration_tokens=window_tokens, distill_epochs=distill_epochs, force=force, evaluate=not no_eval, reference=reference,
        thresholds={"max_kl": max_kl, "min_top1": min_top1}, upload_repo=upload_repo,
        private=private, force_upload=force_upload, progress=not as_json, on_step=on_step,
    )
    if as_json:
        click.echo(render.as_json(report.as_dict()))
