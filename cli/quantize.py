"""`mlxspec quantize`: quantize a model to 4 or 8 bits, save it, gate it (and upload it).

A thin shell over :func:`mlxspec.publish.quantize_flow.quantize_to_dir`, which checks every input
before the slow work and owns the flow.
"""

from __future__ import annotations

import click

from mlxspec.cli.common import gate_options
from mlxspec.cli.quantize_options import FORMATS, METHODS, method_options  # noqa: F401


@click.command("quantize")
@click.argument("model", required=False)
@click.option("--out", "-o", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to write (created atomically; never the source or above it).")
@method_options
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
    from mlxspec.publish.quantize_flow import quantize_to_dir

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
