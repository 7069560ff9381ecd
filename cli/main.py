"""The ``mlxspec`` command group: global options, error reporting, and the list of commands.

Every failure the user can act on ends the same way: one line ``error: <what and how to fix>``
on stderr and exit status 2, whether it is a typed ``MlxspecError``, a click usage error or a
disk that cannot be written. Ctrl-C exits with 130 and no traceback. ``--debug`` adds the
traceback (every exception of the chain) and third-party log lines; tokens are masked everywhere.
"""

from __future__ import annotations

import errno
import importlib
import sys
import traceback
import warnings

import click

from mlxspec import __version__
from mlxspec.errors import MlxspecError

# Module names under mlxspec.cli; each exposes a click command named `command`.
COMMANDS = ("generate", "chat", "models", "bench", "doctor", "eval", "upload", "quantize",
            "batch", "serve")
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
# OSError numbers that mean "this location cannot be written", a user-fixable condition.
NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}
THIRD_PARTY = r"(transformers|huggingface_hub|tokenizers|mlx_lm|httpx|httpx2|urllib3)(\.|$)"


def _debug_requested(args: list[str]) -> bool:
    # --debug is a group option: it precedes the command name.
    for arg in args:
        if arg == "--debug":
            return True
        if not arg.startswith("-"):
            return False
    return False


def _error_line(message: str) -> str:
    from mlxspec.redact import redact

    text = " ".join(redact(str(message)).split()) or "unknown error"
    return f"error: {text}"


def _print_traceback(error: BaseException) -> None:
    from mlxspec.redact import redact

    click.echo(redact("".join(traceback.format_exception(error))).rstrip(), err=True)


def _usage_message(error: click.UsageError) -> str:
    message = error.format_message()
    command = error.ctx.command_path if error.ctx is not None else "mlxspec"
    return f"{message.rstrip('.')}: see `{command} --help`"


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """mlxspec's own warnings (a fallback taken, a slow path) as one ``warning:`` line."""
    from mlxspec.redact import redact

    click.echo(f"warning: {' '.join(redact(str(message)).split())}", err=True)


class _Group(click.Group):
    """Loads each command on first use and turns every user-facing failure into one line."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        return importlib.import_module(f"mlxspec.cli.{name}").command

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args)
        debug = _debug_requested(args)
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = result if isinstance(result, int) else 0
        except KeyboardInterrupt:
            click.echo("", err=True)  # end the line ^C was echoed on
            code = EXIT_INTERRUPTED
        except click.exceptions.Abort:  # Ctrl-C or Ctrl-D; click has ended the line
            code = EXIT_INTERRUPTED
        except click.UsageError as e:
            click.echo(_error_line(_usage_message(e)), err=True)
            code = e.exit_code
        except click.ClickException as e:
            click.echo(_error_line(e.format_message()), err=True)
            code = 2
        except MlxspecError as e:
            if debug:
                _print_traceback(e)
            click.echo(_error_line(str(e)), err=True)
            code = e.exit_code
        except OSError as e:
            if e.errno == errno.EPIPE:  # the reader went away (`| head`): nothing to say
                code = 1
            elif e.errno not in NOT_WRITABLE:
                _print_traceback(e)
                code = 1
            else:
                if debug:
                    _print_traceback(e)
                where = e.filename or "the output location"
                click.echo(_error_line(
                    f"cannot write {where}: {e.strerror}; free some space or choose a writable "
                    "location (MLXSPEC_HOME for the cache)"), err=True)
                code = 2
        except Exception as e:  # a bug: keep the traceback, but never a token
            _print_traceback(e)
            code = 1
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
        warnings.showwarning = _one_line_warning


def main() -> None:
    """Console-script entry point."""
    cli()


if __name__ == "__main__":
    main()
