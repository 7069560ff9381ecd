"""How every failure of a command reaches the user: one line ``error: <what and how to fix>`` on
stderr and exit status 2 for what the user can act on (a typed ``MlxspecError``, a click usage
error, a location that cannot be written); 130 and no traceback for Ctrl-C; a traceback (tokens
masked) only for a bug, or with ``--debug``."""

from __future__ import annotations

import errno
import traceback
from collections.abc import Callable
from typing import Any

import click

from mlxspec.errors import MlxspecError

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
# OSError numbers that mean "this location cannot be written", a user-fixable condition.
NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


def error_line(message: str) -> str:
    from mlxspec.redact import redact

    text = " ".join(redact(str(message)).split()) or "unknown error"
    return f"error: {text}"


def print_traceback(error: BaseException) -> None:
    from mlxspec.redact import redact

    click.echo(redact("".join(traceback.format_exception(error))).rstrip(), err=True)


def one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """mlxspec's own warnings (a fallback taken, a slow path) as one ``warning:`` line."""
    from mlxspec.redact import redact

    click.echo(f"warning: {' '.join(redact(str(message)).split())}", err=True)


def _usage_message(error: click.UsageError) -> str:
    message = error.format_message()
    command = error.ctx.command_path if error.ctx is not None else "mlxspec"
    return f"{message.rstrip('.')}: see `{command} --help`"


def run_reporting_failures(run: Callable[[], Any], debug: bool) -> int:
    """``run()``'s exit status: its integer result (0 otherwise), or the status of the failure
    it raised, reported as described above."""
    try:
        result = run()
        return result if isinstance(result, int) else 0
    except KeyboardInterrupt:
        click.echo("", err=True)  # end the line ^C was echoed on
        return EXIT_INTERRUPTED
    except click.exceptions.Abort:  # Ctrl-C or Ctrl-D; click has ended the line
        return EXIT_INTERRUPTED
    except click.UsageError as e:
        click.echo(error_line(_usage_message(e)), err=True)
        return e.exit_code
    except click.ClickException as e:
        click.echo(error_line(e.format_message()), err=True)
        return 2
    except MlxspecError as e:
        if debug:
            print_traceback(e)
        click.echo(error_line(str(e)), err=True)
        return e.exit_code
    except OSError as e:
        if e.errno == errno.EPIPE:  # the reader went away (`| head`): nothing to say
            return 1
        if e.errno not in NOT_WRITABLE or debug:
            print_traceback(e)
        if e.errno not in NOT_WRITABLE:
            return 1
        where = e.filename or "the output location"
        click.echo(error_line(
            f"cannot write {where}: {e.strerror}; free some space or choose a writable "
            "location (MLXSPEC_HOME for the cache)"), err=True)
        return 2
    except Exception as e:  # a bug: keep the traceback, but never a token
        print_traceback(e)
        return 1
