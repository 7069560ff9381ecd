"""The ``mlxspec`` command group: global options and the list of commands, each loaded on first
use. Failures are reported by :mod:`mlxspec.cli.failures` (one ``error:`` line, exit status 2);
``--debug`` adds tracebacks and third-party log lines; tokens are masked everywhere.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import click

from mlxspec import __version__
from mlxspec.cli.failures import one_line_warning, run_reporting_failures

# Module names under mlxspec.cli; each exposes a click command named `command`.
COMMANDS = ("generate", "chat", "models", "bench", "doctor", "eval", "upload", "quantize",
            "batch", "serve", "train-draft")
THIRD_PARTY = r"(transformers|huggingface_hub|tokenizers|mlx_lm|httpx|httpx2|urllib3)(\.|$)"


def _debug_requested(args: list[str]) -> bool:
    # --debug is a group option: it precedes the command name.
    for arg in args:
        if arg == "--debug":
            return True
        if not arg.startswith("-"):
            return False
    return False


class _Group(click.Group):
    """Loads each command on first use and turns every user-facing failure into one line."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        return importlib.import_module(f"mlxspec.cli.{name.replace('-', '_')}").command

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args)
        code = run_reporting_failures(
            lambda: super(_Group, self).main(args, prog_name, complete_var,
                                             standalone_mode=False, **extra),
            debug=_debug_requested(args))
        if standalone_mode:
            sys.exit(code or 0)
        return code


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlxspec")
@click.option("--debug", is_flag=True, help="Show full tracebacks and library log lines.")
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
    from mlxspec.redact import quiet_library_logs

    quiet_library_logs(debug)
    if not debug:
        warnings.filterwarnings("ignore", module=THIRD_PARTY)
        warnings.showwarning = one_line_warning


def main() -> None:
    """Console-script entry point."""
    cli()


if __name__ == "__main__":
    main()
