"""The ``mlxspec`` command group: global options, error reporting, and the list of commands."""

from __future__ import annotations

import importlib
import sys
import traceback

import click

from mlxspec import __version__
from mlxspec.errors import MlxspecError

# Module names under mlxspec.cli; each exposes a click command named `command`.
COMMANDS = ("generate", "chat", "models", "bench", "doctor", "eval", "upload", "quantize", "batch", "serve")


class _Group(click.Group):
    """Turns user-facing errors into one line and exit status 2 (traceback with --debug)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MlxspecError as e:
            if ctx.meta.get("mlxspec.debug"):
                traceback.print_exc()
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlxspec")
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """mlxspec: fast local LLM inference on MLX.

    Zero-point weight quantization with custom Metal kernels, and lossless speculative decoding.
    With no --model, commands use the embedded default (SmolLM2-135M-Instruct).

    \b
    Examples:
      mlxspec generate --prompt "Write a haiku about the sea"
      mlxspec chat --draft-model ./smollm2-q4
      mlxspec models
    """
    ctx.meta["mlxspec.debug"] = debug


for _name in COMMANDS:
    cli.add_command(importlib.import_module(f"mlxspec.cli.{_name}").command)


def main() -> None:
    """Console-script entry point."""
    cli()


if __name__ == "__main__":
    main()
