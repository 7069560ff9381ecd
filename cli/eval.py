"""`mlxspec eval`: perplexity, divergence from a reference model, or a draft's acceptance rate.

A thin shell over :func:`mlxspec.evaluation.evaluate` (and ``evaluate_saved`` for --save).
"""

from __future__ import annotations

import click

from mlxspec.cli.common import gate_options


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
              help="Evaluate on the built-in held-out text by domain: prose, code, chat, "
                   "technical (the default).")
@click.option("--windows", "-n", default=None, type=click.IntRange(min=1),
              help="Number of token windows: per domain of the built-in text (default 4), or of "
                   "--text (default 8).")
@click.option("--window-tokens", "-t", default=256, show_default=True,
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
    perplexity: on the built-in held-out text per domain (prose, code, chat, technical), pooled
    and for the worst domain, which the quality gate judges. With --draft, prints the expected acceptance rate at temperatures 0, 0.7 and 1
    and the tokens each target pass would yield for 1 to 8 drafted tokens.

    \b
    Examples:
      mlxspec eval ./smollm2-q4                      # against the model it was quantized from
      mlxspec eval ./smollm2-q4 --reference ./smollm2 --windows 32 --json
      mlxspec eval ./target --draft ./smollm2-q4     # predicted speculative speed-up
      mlxspec eval ./model --text book.txt --window-tokens 512
      mlxspec eval ./smollm2-q4 --save --max-kl 0.05   # re-judge and store the results
    """
    from mlxspec.cli import render
    from mlxspec.errors import EvaluationError
    from mlxspec.evaluation import evaluate, evaluate_saved

    if text and builtin:
        raise EvaluationError("--text and --builtin exclude each other: pass one of them")
    if draft and save:
        raise EvaluationError("--draft excludes --save: pass one of them")
    if save:
        from mlxspec.load import resolve_model_path

        record = evaluate_saved(
            resolve_model_path(model), reference=reference, text=text, windows=windows,
            window_tokens=window_tokens, thresholds={"max_kl": max_kl, "min_top1": min_top1},
            progress=not as_json,
        )
        if as_json:
            click.echo(render.as_json({"model": str(model), **record}))
        else:
            click.echo(render.record_table(str(model), record))
        return
    result = evaluate(model, reference, draft, text=text, windows=windows,
                      window_tokens=window_tokens, progress=not as_json)
    click.echo(render.as_json(result) if as_json else render.evaluation_table(result))
