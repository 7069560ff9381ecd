"""`mlxspec chat`: an interactive multi-turn chat that reuses the KV cache across turns."""

from __future__ import annotations

import sys

import click

from mlxspec.cli.chat_loop import run_conversation
from mlxspec.cli.common import check_text, model_option, sampling_options, shard_option
from mlxspec.cli.speculative_options import kv_bits_option, load_draft, speculative_options


@click.command("chat")
@model_option
@click.option("--system", default=None, help="System prompt.")
@click.option("--max-kv-size", default=None, type=click.IntRange(min=16),
              help="Keep at most this many tokens in a rotating KV cache.")
@click.option("--live-stats", is_flag=True, help="Print a statistics line after every reply.")
@sampling_options
@speculative_options
@kv_bits_option
@shard_option
def command(model, system, max_kv_size, live_stats, max_tokens, temp, top_p, top_k, min_p,
            seed, draft_model, num_draft_tokens, prompt_lookup, ngram_max, draft_min_confidence,
            kv_bits, shard):
    """Chat with a model. Only each new turn is prefilled: the KV cache is kept between turns.

    Reads one user turn per line; works in a terminal and from a pipe.

    \b
    Examples:
      mlxspec chat
      mlxspec chat --system "You answer in one sentence." --temp 0.7
      printf 'Hi!\\nWhat did I just say?\\n' | mlxspec chat
    \b
    In the chat: /reset, /system TEXT, /stats, /help, /quit; Ctrl-C stops a reply, Ctrl-D exits.
    With --shard (under mlx.launch) rank 0 reads the lines; end the input with /quit (mlx.launch
    does not pass end-of-input on), and Ctrl-C ends the chat, not only the reply.
    """
    from mlxspec.benchmark import model_bytes
    from mlxspec.chat import ChatSession
    from mlxspec.distributed import agreed_decoding, is_primary, load_sharded
    from mlxspec.distributed.chat import LeadingChat, follow_chat

    if system is not None:
        check_text(system, "--system")
    nn_model, tokenizer = load_sharded(model, shard)
    if shard is not None:  # every rank samples alike: rank 0's seed
        num_draft_tokens, seed = agreed_decoding(num_draft_tokens, seed)
    leads = shard is not None and is_primary()
    draft, draft_tokenizer = load_draft(draft_model)
    session = (LeadingChat if leads else ChatSession)(
        nn_model, tokenizer, system=system, max_kv_size=max_kv_size, max_tokens=max_tokens,
        temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, draft_model=draft,
        draft_tokenizer=draft_tokenizer, num_draft_tokens=num_draft_tokens,
        prompt_lookup=prompt_lookup, ngram_max=ngram_max,
        draft_min_confidence=draft_min_confidence, kv_bits=kv_bits,
    )
    if shard is not None and not leads:
        follow_chat(session)  # the same turns as rank 0, until it ends the conversation
        return
    interactive = sys.stdin.isatty()
    ok = run_conversation(session, model_bytes(nn_model), live_stats=live_stats,
                          interactive=interactive, interruptible=shard is None)
    if leads:
        session.end()
    if not ok:
        sys.exit(2)
