"""The conversation loop of ``mlxspec chat``: one user turn per line (a terminal or a pipe), the
slash commands, replies streamed as they are generated."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from mlxspec.cli.common import check_text, read_text
from mlxspec.cli.render import stats_line
from mlxspec.errors import MlxspecError

if TYPE_CHECKING:
    from mlxspec.chat import ChatSession

HELP = """commands:
  /reset         forget the conversation
  /system TEXT   set the system prompt (empty TEXT removes it)
  /stats         statistics of the last reply
  /help          this help
  /quit          exit (Ctrl-D too); Ctrl-C stops a reply"""


def _read_line(interactive: bool) -> str | None:
    """One line of user input, or None at end of input (Ctrl-D).

    Raises ``InvalidArgumentError`` for a line that is not valid UTF-8 (the caller reports it and
    goes on with the conversation).
    """
    try:
        if interactive:
            return check_text(input(">> "), "this line")
        line = sys.stdin.buffer.readline()
        return read_text(line, "this line").rstrip("\r\n") if line else None
    except EOFError:
        return None


def run_conversation(session: ChatSession, nbytes: int, *, live_stats: bool,
                     interactive: bool, interruptible: bool = True) -> bool:
    """Talk until end of input or /quit; returns False when a line or a turn was refused (the
    conversation went on past it). ``nbytes``: the model's bytes read per token, for /stats.
    ``interruptible=False`` (a sharded chat, whose other ranks generate every reply to its end):
    Ctrl-C during a reply ends the chat instead of the reply."""
    from mlxspec.distributed.group import waiting_for_input

    if interactive:
        sys.stdin.reconfigure(errors="surrogateescape")  # a bad line is reported, not fatal
        click.echo("mlxspec chat — /help for commands, Ctrl-D to exit.")
    failed = False
    while True:
        try:
            with waiting_for_input(session.model):  # a sharded model's watchdog: not a failure
                line = _read_line(interactive)
        except KeyboardInterrupt:
            click.echo("\n(Ctrl-D or /quit exits)")
            continue
        except MlxspecError as e:
            click.echo(f"error: {e}; the line was skipped", err=True)
            failed = True
            continue
        if line is None or line.strip() in ("/quit", "/exit"):
            break
        text = line.strip()
        if not text:
            continue
        if text == "/help":
            click.echo(HELP)
        elif text == "/reset":
            session.reset()
            click.echo("(conversation cleared)")
        elif text == "/system" or text.startswith("/system "):
            session.set_system(text[len("/system"):].strip() or None)
            click.echo("(system prompt set)" if session.system else "(system prompt removed)")
        elif text == "/stats":
            click.echo(_stats(session, nbytes) if session.last else "(no reply yet)")
        elif text.startswith("/"):
            click.echo(f"unknown command {text.split()[0]}; /help lists them")
        else:
            reply = session.stream_reply(text)
            try:
                for response in reply:
                    click.echo(response.text, nl=False)
            except KeyboardInterrupt:
                if not interruptible:
                    raise
                click.echo(" [interrupted]", nl=False)
            except MlxspecError as e:  # this turn was refused; the conversation goes on
                click.echo(f"error: {e}", err=True)
                failed = True
                continue
            finally:
                reply.close()  # records the (partial) reply and re-syncs the cache
            click.echo()
            if live_stats and session.last:
                click.echo(_stats(session, nbytes), err=True)
    return not failed


def _stats(session, nbytes: int) -> str:
    line = stats_line(session.last, nbytes)
    line += f" | prefilled this turn: {session.prefilled_tokens} (rest from cache)"
    if session.last.spec_stats is not None:
        line += "\n" + session.last.spec_stats.summary()
    return line
