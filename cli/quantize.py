"""`mlxspec quantize`: quantize a model to 4 or 8 bits and save it."""

from __future__ import annotations

from pathlib import Path

import click
from mlxspec.cli.eval import gate_options

from mlxspec.quant.quantize import (
    CALIBRATED,
    DEFAULT_CALIBRATION_TOKENS,
    DEFAULT_CALIBRATION_WINDOWS,
    METHODS,
)


@click.command("quantize")
@click.argument("model", required=False)
@click.option("--out", "-o", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to write (created atomically).")
@click.option("--bits", "-b", default=4, show_default=True, type=int,
              help="Bits per weight: 4 or 8 (2 and 3 also work, with a large quality loss).")
@click.option("--group-size", "-g", default=64, show_default=True, type=int,
              help="Weights sharing one scale and zero-point: 32, 64 or 128.")
@click.option("--method", default="gptq", show_default=True, type=click.Choice(list(METHODS)),
              help="rtn: round-to-nearest with a clipping search; gptq: calibrated (error "
                   "feedback), slower; awq: calibrated (activation-aware scales folded into the "
                   "norms).")
@click.option("--format", "output_format", default="zp", show_default=True,
              type=click.Choice(["zp", "mlx"]),
              help="zp: mlxspec zero-point (loaded by mlxspec); mlx: standard mlx-lm affine "
                   "(loaded by plain mlx_lm.load; exact conversion).")
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
              help="Calibration text for gptq/awq (UTF-8; default: the built-in public-domain "
                   "text).")
@click.option("--calibration-windows", "n_windows", default=DEFAULT_CALIBRATION_WINDOWS,
              show_default=True,
              type=click.IntRange(min=1), help="gptq/awq: number of calibration windows.")
@click.option("--calibration-tokens", "window_tokens", default=DEFAULT_CALIBRATION_TOKENS,
              show_default=True,
              type=click.IntRange(min=8), help="gptq/awq: tokens per calibration window.")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists.")
@click.option("--no-eval", is_flag=True,
              help="Skip the quality gate (evaluation against the source model).")
@gate_options
@click.option("--upload-repo", default=None,
              help="Then upload the result to this Hub repo ('user/name') with a model card.")
@click.option("--private", is_flag=True, help="With --upload-repo: create the repo private.")
@click.option("--force-upload", is_flag=True,
              help="With --upload-repo: upload even without passing evaluation results.")
def command(model, out_dir, bits, group_size, method, output_format, recipe, group_fallback,
            act_order, calibration, n_windows, window_tokens, force, no_eval,
            max_kl, min_top1, upload_repo, private, force_upload):
    """Quantize MODEL's weights to BITS bits with a per-group scale and zero-point, and save it.

    MODEL is a Hub repo id, a model directory or a .gguf file (default: the embedded model). The
    output directory holds the weights, config.json (with a "quantization" record: method, bits,
    group size, format, mlxspec version, calibration text hash, source model), the tokenizer and
    the chat template. It prints the resulting bits per weight.

    \b
    Examples:
      mlxspec quantize --out smollm2-q4                     # 4-bit GPTQ, group size 64
      mlxspec quantize --out smollm2-q4 --mixed embed8      # head and embeddings at 8 bits
      mlxspec quantize --out smollm2-q8 --bits 8 --method rtn
      mlxspec quantize --out smollm2-awq --method awq       # activation-aware scaling
      mlxspec quantize model.gguf --out model-mlx --format mlx   # for plain mlx_lm.load
      mlxspec quantize --out q4 -g 128 --group-fallback     # g128 where the width allows
      mlxspec quantize --out smollm2-q4 --upload-repo me/smollm2-q4   # gate, then upload
    """
    from mlxspec.errors import OutputExistsError, QuantizationError
    from mlxspec.load import load, read_config, resolve_model_path
    from mlxspec.quant import format
    from mlxspec.quant.mixed import load_recipe, sensitivity_recipe
    from mlxspec.quant.quantize import calibration_windows, quantize_model, save_quantized

    # Everything checkable without the model fails before the (slow) load.
    format.check_spec(bits, group_size, group_size)
    if act_order and output_format == "mlx":
        raise QuantizationError("--act-order needs --format zp: MLX's affine format cannot "
                                "express the column permutation")
    if act_order and method != "gptq":
        raise QuantizationError("--act-order applies to --method gptq only")
    out = Path(out_dir)
    if out.exists() and not force:
        raise OutputExistsError(f"{out} exists: pass --force to overwrite it")
    target_bpw = _auto_target(recipe, bits)
    mixed = load_recipe(recipe) if recipe and target_bpw is None else None
    model_dir = resolve_model_path(model)
    config = read_config(model_dir)
    if config.get("quantization") or config.get("quantization_config"):
        raise QuantizationError(
            f"{model_dir} is already quantized: quantize its unquantized source instead"
        )

    nn_model, tokenizer = load(str(model_dir))
    extra = {"source_model": _source_name(model)}
    tokens = None
    if method in CALIBRATED:
        tokens, sha256 = calibration_windows(
            tokenizer, calibration, windows=n_windows, window_tokens=window_tokens
        )
        extra.update(
            calibration_sha256=sha256,
            calibration="builtin" if calibration is None else Path(calibration).name,
            calibration_windows=len(tokens),
            calibration_window_tokens=window_tokens,
        )
    if target_bpw is not None:
        probe, _ = calibration_windows(tokenizer, calibration, windows=2, window_tokens=128)
        mixed = sensitivity_recipe(
            nn_model, probe, bits=bits, group_size=group_size, target_bpw=target_bpw,
            group_fallback=group_fallback,
        )
        extra["sensitivity"] = mixed["sensitivity"]
        click.echo(f"mixed precision: {mixed['description']}")
    nn_model, quantization = quantize_model(
        nn_model, bits=bits, group_size=group_size, method=method, calibration_tokens=tokens,
        recipe=mixed, act_order=act_order, group_fallback=group_fallback, progress=True,
    )
    save_quantized(
        nn_model, out, config=config, quantization=quantization, source_dir=model_dir,
        output_format=output_format, force=force, extra=extra,
    )
    exceptions = quantization["layers"]
    click.echo(
        f"{method} {bits}-bit, group size {group_size}"
        + (f", recipe {quantization['recipe']}" if quantization["recipe"] else "")
        + (f", {len(exceptions)} layers differ (see config.json)" if exceptions else "")
        + f": {quantization['bits_per_weight']:.3f} bits per weight"
    )
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    click.echo(f"wrote {out} ({size / 1e6:.1f} MB of weights, format {output_format})")
    if not no_eval:
        from mlxspec.cli.eval import comparison_table

        from mlxspec.eval import EVAL_FILE, evaluate_saved, verdict_line

        record = evaluate_saved(
            out, reference=str(model_dir), thresholds={"max_kl": max_kl, "min_top1": min_top1}
        )
        click.echo(comparison_table({"model": str(out), **record, **record["results"]}))
        click.echo(f"quality gate: {verdict_line(record['verdict'])} (stored in {out / EVAL_FILE})")
    if upload_repo:
        from mlxspec.hub import upload

        url = upload(out, upload_repo, private=private, force=force_upload)
        click.echo(f"uploaded {out} to {url}")


def _auto_target(recipe: str | None, bits: int) -> float | None:
    """The bits-per-weight target of ``--mixed auto[:BPW]``, or None for a recipe."""
    from mlxspec.errors import QuantizationError

    if not recipe or not (recipe == "auto" or recipe.startswith("auto:")):
        return None
    if recipe == "auto":
        return bits + 0.5
    try:
        return float(recipe[5:])
    except ValueError as e:
        raise QuantizationError(f"--mixed {recipe}: give auto or auto:BPW, e.g. auto:4.6") from e


def _source_name(model: str | None) -> str:
    """What the config records as the source: "default", an absolute path, or a Hub id."""
    if model is None:
        return "default"
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model
