"""`mlxspec eval`: perplexity, divergence from a reference model, or a draft's acceptance rate."""

from __future__ import annotations

import json

import click

from mlxspec.eval import DEFAULT_WINDOW_TOKENS, DEFAULT_WINDOWS, MAX_DRAFT_TOKENS


def gate_options(f):
    """--max-kl and --min-top1: the quality gate's thresholds (defaults depend on the bits)."""
    options = [
        click.option("--max-kl", type=click.FloatRange(min=0.0), default=None,
                     help="Gate: highest mean KL divergence in nats/token (default: 0.01 at 8 "
                          "bits, 0.10 at 4 bits and below)."),
        click.option("--min-top1", type=click.FloatRange(0.0, 100.0), default=None,
                     help="Gate: lowest same-top-1 agreement in % (default: 97 at 8 bits, 88 "
                          "at 4 bits and below)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@click.command("eval")
@click.argument("model", required=False)
@click.option("--reference", "-r", default=None,
              help="Model to compare with (default: the source recorded in a quantized model's "
                   "config.json).")
@click.option("--draft", "-d", default=None,
              help="Predict speculative decoding with this draft instead: acceptance rate and "
                   "tokens per target pass.")
@click.option("--text", type=click.Path(dir_okay=False), default=None,
              help="Evaluate on this UTF-8 text file (streamed).")
@click.option("--builtin", is_flag=True,
              help="Evaluate on the built-in held-out text (the default).")
@click.option("--windows", "-n", default=DEFAULT_WINDOWS, show_default=True,
              type=click.IntRange(min=1), help="Number of token windows.")
@click.option("--window-tokens", "-t", default=DEFAULT_WINDOW_TOKENS, show_default=True,
              type=click.IntRange(min=2), help="Tokens per window.")
@click.option("--save", is_flag=True,
              help="For a quantized model: judge it against the gate and store the results in its "
                   "directory (mlxspec_eval.json), as `mlxspec quantize` does.")
@gate_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def command(model, reference, draft, text, builtin, windows, window_tokens, save, max_kl,
            min_top1, as_json):
    """Measure MODEL's quality on fixed token windows, without generating.

    MODEL is a Hub repo id, a model directory or a .gguf file (default: the embedded model).
    Prints perplexity with its standard error and, against a reference model on the very same
    windows, mean and 99th-percentile KL divergence, same-top-1 agreement and the change in
    perplexity. With --draft, prints the expected acceptance rate at temperatures 0, 0.7 and 1
    and the tokens each target pass would yield for 1 to 8 drafted tokens.

    \b
    Examples:
      mlxspec eval ./smollm2-q4                      # against the model it was quantized from
      mlxspec eval ./smollm2-q4 --reference ./smollm2 --windows 32 --json
      mlxspec eval ./target --draft ./smollm2-q4     # predicted speculative speed-up
      mlxspec eval ./model --text book.txt --window-tokens 512
      mlxspec eval ./smollm2-q4 --save --max-kl 0.05   # re-judge and store the results
    """
    from mlxspec.errors import EvaluationError
    from mlxspec.eval import (
        acceptance,
        check_same_tokenizer,
        compare,
        dense_on_cpu,
        evaluate_saved,
        load_reference,
        perplexity,
        source_model,
        take_windows,
        verdict_line,
    )
    from mlxspec.load import load, read_config, resolve_model_path

    if text and builtin:
        raise EvaluationError("--text and --builtin exclude each other: pass one of them")
    if draft and (reference or save):
        raise EvaluationError("--draft excludes --reference and --save: pass one of them")
    model_dir = resolve_model_path(model)
    if save:
        record = evaluate_saved(
            model_dir, reference=reference, thresholds={"max_kl": max_kl, "min_top1": min_top1},
            text=text, windows=windows, window_tokens=window_tokens, progress=not as_json,
        )
        result = {"model": str(model), "text": record["text"], "window_tokens": window_tokens,
                  "reference": record["reference"], **record["results"],
                  "verdict": record["verdict"]}
        if as_json:
            click.echo(json.dumps(result, indent=2))
        else:
            click.echo(comparison_table(result))
            click.echo(verdict_line(record["verdict"]))
        return
    nn_model, tokenizer = load(model_dir)
    nn_model = dense_on_cpu(nn_model)
    token_windows = take_windows(tokenizer, text, windows, window_tokens)
    header = {
        "model": str(model if model is not None else model_dir),
        "text": text or "builtin",
        "windows": len(token_windows),
        "window_tokens": window_tokens,
    }
    if draft:
        draft_model, draft_tokenizer = load(draft)
        check_same_tokenizer(tokenizer, draft_tokenizer, "the draft model")
        draft_model = dense_on_cpu(draft_model)
        result = {**header, "draft": draft,
                  **acceptance(nn_model, draft_model, token_windows, progress=not as_json)}
        _print(result, as_json, _acceptance_table)
        return
    reference = reference or source_model(read_config(model_dir))
    if reference is None:
        result = {**header, **perplexity(nn_model, token_windows, progress=not as_json)}
        _print(result, as_json, _perplexity_table)
        return
    reference_model, reference_tokenizer = load_reference(reference)
    check_same_tokenizer(tokenizer, reference_tokenizer)
    reference_model = dense_on_cpu(reference_model)
    result = {**header, "reference": reference,
              **compare(nn_model, reference_model, token_windows, progress=not as_json)}
    _print(result, as_json, comparison_table)


def _print(result: dict, as_json: bool, table) -> None:
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(table(result))


def _about(r: dict) -> str:
    return (f"{r['model']} on {r['text']} text: {r['windows']} windows x {r['window_tokens']} "
            f"tokens ({r['tokens']} scored)")


def _perplexity_table(r: dict) -> str:
    return "\n".join([
        _about(r),
        f"  perplexity            {r['perplexity']:.3f} ± {r['perplexity_se']:.3f}",
        "  (no reference: pass --reference to measure the divergence from another model)",
    ])


def comparison_table(r: dict) -> str:
    """The comparison of a model with its reference as aligned text lines."""
    return "\n".join([
        _about(r),
        f"  reference             {r['reference']}",
        f"  perplexity            {r['perplexity']:.3f} ± {r['perplexity_se']:.3f}",
        f"  reference perplexity  {r['reference_perplexity']:.3f} ± "
        f"{r['reference_perplexity_se']:.3f}",
        f"  perplexity change     {r['perplexity_delta']:+.3f} ({r['perplexity_delta_pct']:+.2f}%)",
        f"  mean KL               {r['kl_mean']:.5f} nats/token",
        f"  p99 KL                {r['kl_p99']:.5f} nats/token",
        f"  top-1 agreement       {r['top1_agreement']:.2f}%",
    ])


def _acceptance_table(r: dict) -> str:
    ks = range(1, MAX_DRAFT_TOKENS + 1)
    lines = [
        _about(r),
        f"  draft {r['draft']}: expected acceptance rate and tokens per target pass for k drafted",
        "  temp   alpha  " + "".join(f"  k={k:<3d}" for k in ks),
    ]
    for temp, row in r["temperatures"].items():
        per_k = "".join(f"  {row['tokens_per_pass'][str(k)]:5.2f}" for k in ks)
        lines.append(f"  {temp:<5s}  {row['alpha']:.3f}{per_k}")
    return "\n".join(lines)
