"""`mlxspec models`: the default model, converted and cached models, and the recipes."""

from __future__ import annotations

import json

import click


@click.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def command(as_json):
    """List mlxspec's cache (and its size), the embedded default model, converted GGUF models,
    Hub downloads and recipes.

    \b
    Example:
      mlxspec models
    """
    from mlxspec.catalog import list_models

    entries = list_models()
    if as_json:
        click.echo(json.dumps(entries, indent=2))
        return
    for section in ("cache", "default", "converted", "hub", "recipe"):
        rows = [e for e in entries if e["kind"] == section]
        if not rows:
            continue
        click.echo(f"{section}:")
        for e in rows:
            click.echo(f"  {e['name']}" + (f"  ({e['detail']})" if e.get("detail") else ""))
