"""`mlxspec bench`: decode speed, achieved bandwidth and roofline, side by side with mlx-lm.

A thin shell over :func:`mlxspec.benchmark.compare_decode`.
"""

from __future__ import annotations

import click

from mlxspec.cli.common import model_option, shard_option


@click.command("bench")
@model_option
@click.option("--prompt", default=None, help="Prompt to decode from (a default story prompt).")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=8))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--draft", default="auto", show_default=True,
              help="Also decode with this feature draft (EAGLE-3 head): 'auto' (the head shipped "
                   "for this model, if any), a head's directory, or 'none'.")
@shard_option
def command(model, prompt, max_tokens, repeats, as_json, draft, shard):
    """Measure prompt and decode tokens/s, achieved bandwidth and roofline fraction for mlxspec
    and plain mlx-lm on the same model and prompt, in one run.

    \b
    Examples:
      mlxspec bench
      mlxspec bench -m ./smollm2-q4 --max-tokens 128 --json

    With --shard (under mlx.launch) every rank runs the same decodes on its shard and rank 0
    reports them; rank 0 chooses the draft lengths.
    """
    from mlxspec.benchmark import DEFAULT_PROMPT, compare_decode
    from mlxspec.cli import render

    result = compare_decode(
        model, prompt=prompt or DEFAULT_PROMPT, max_tokens=max_tokens, repeats=repeats,
        progress=None if as_json else (lambda msg: click.echo(f"... {msg}", err=True)),
        draft=draft, shard=shard,
    )
    click.echo(render.as_json(result) if as_json else render.bench_table(result))
