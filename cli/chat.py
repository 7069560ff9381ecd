"""`mlxspec chat`: an interactive multi-turn chat that reuses the KV cache across turns."""

from __future__ import annotations

import sys

import click

from mlxspec.cli.common import model_option, sampling_options
from mlxspec.cli.render import stats_line
from mlxspec.cli.speculative_options import (
    check_text,
    kv_bits_option,
    load_draft,
    read_text,
    speculative_options,
)

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


@click.command("chat")
@model_option
@click.option("--system", default=None, help="System prompt.")
@click.option("--max-kv-size", default=None, type=click.IntRange(min=16),
              help="Keep at most this many tokens in a rotating KV cache.")
@click.option("--live-stats", is_flag=True, help="Print a statistics line after every reply.")
@sampling_options
@speculative_options
@kv_bits_option
def command(model, system, max_kv_size, live_stats, max_tokens, temp, top_p, top_k, min_p,
            seed, draft_model, num_draft_tokens, prompt_lookup, ngram_max, draft_min_confidence,
            kv_bits):
    """Chat with a model. Only each new turn is prefilled: the KV cache is kept between turns.

    Reads one user turn per line; works in a terminal and from a pipe.

    \b
    Examples:
      mlxspec chat
      mlxspec chat --system "You answer in one sentence." --temp 0.7
      printf 'Hi!\\nWhat did I just say?\\n' | mlxspec chat
    \b
    In the chat: /reset, /system TEXT, /stats, /help, /quit; Ctrl-C stops a reply, Ctrl-D exits.
    """
    from mlxspec.benchmark import model_bytes
    from mlxspec.chat import ChatSession
    from mlxspec.errors import MlxspecError
    from mlxspec.load import load

    if system is not None:
        check_text(system, "--system")
    nn_model, tokenizer = load(model)
    draft, draft_tokenizer = load_draft(draft_model)
    session = ChatSession(
        nn_model, tokenizer, system=system, max_kv_size=max_kv_size, max_tokens=max_tokens,
        temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, draft_model=draft,
        draft_tokenizer=draft_tokenizer, num_draft_tokens=num_draft_tokens,
        prompt_lookup=prompt_lookup, ngram_max=ngram_max,
        draft_min_confidence=draft_min_confidence, kv_bits=kv_bits,
    )
    nbytes = model_bytes(nn_model)
    interactive = sys.stdin.isatty()
    if interactive:
        sys.stdin.reconfigure(errors="surrogateescape")  # a bad line is reported, not fatal
        click.echo("mlxspec chat — /help for commands, Ctrl-D to exit.")
    failed = False
    while True:
        try:
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


    if failed:
        sys.exit(2)


def _stats(session, nbytes: int) -> str:
    line = stats_line(session.last, nbytes)
    line += f" | prefilled this turn: {session.prefilled_tokens} (rest from cache)"
    if session.last.spec_stats is not None:
        line += "\n" + session.last.spec_stats.summary()
    return line
