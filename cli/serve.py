"""`mlxspec serve`: an OpenAI-compatible HTTP server with continuous batching."""

from __future__ import annotations

import logging

import click

from mlxspec.cli.common import model_option, shard_option
from mlxspec.cli.speculative_options import speculative_options


@click.command("serve")
@model_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback exposes the model to the network.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", default=None, envvar="MLXSPEC_API_KEY",
              help="Require 'Authorization: Bearer <key>' (also $MLXSPEC_API_KEY).")
@click.option("--max-tokens", default=512, show_default=True, type=click.IntRange(min=1),
              help="max_tokens of a request that does not set it.")
@click.option("--max-tokens-limit", default=4096, show_default=True, type=click.IntRange(min=1),
              help="The largest max_tokens a request may ask for.")
@click.option("--max-context", default=None, type=click.IntRange(min=16),
              help="Prompt + completion tokens per request (default: the model's context).")
@click.option("--max-concurrent", default=64, show_default=True, type=click.IntRange(min=1),
              help="Open requests at once; more get 429.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(min=1))
@click.option("--max-batch", default=32, show_default=True, type=click.IntRange(min=1),
              help="Streams decoded together.")
@click.option("--prefill-step", default=512, show_default=True, type=click.IntRange(min=16),
              help="Prompt tokens per forward: long prompts are prefilled in chunks.")
@click.option("--prompt-cache-size", default=8, show_default=True, type=click.IntRange(min=0),
              help="Finished conversations kept for prefix reuse (0: off).")
@click.option("--allow-origin", "allowed_origins", multiple=True,
              help="A web origin whose pages may call the server (CORS; repeatable; '*': any).")
@click.option("--drain-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds SIGTERM / Ctrl-C waits for open requests.")
@speculative_options
@shard_option
def command(model, host, port, api_key, max_tokens, max_tokens_limit, max_context, max_concurrent,
            max_body_bytes, max_batch, prefill_step, prompt_cache_size, allowed_origins,
            drain_timeout, draft_model, num_draft_tokens, prompt_lookup, ngram_max,
            draft_min_confidence, shard):
    """Serve the model over an OpenAI-compatible API (as mlx_lm.server).

    Routes: POST /v1/chat/completions, POST /v1/completions (streaming with "stream": true),
    GET /v1/models, GET /health. Concurrent requests are batched; a lone request decodes
    speculatively with the feature draft (--draft, by default the head shipped for the model),
    a draft model or --prompt-lookup.

    \b
    Examples:
      mlxspec serve
      mlxspec serve --prompt-lookup --port 8000
      mlxspec serve --host 0.0.0.0 --api-key "$KEY"

    With --shard (under mlx.launch) rank 0 serves HTTP and every step of its engine is replayed
    by the other ranks (batching and speculation included); a lost rank ends the server.
    """
    from mlxspec.serving.http import serve_forever
    from mlxspec.serving.launch import is_loopback, start_server

    if not is_loopback(host) and not api_key:
        click.echo(f"warning: serving on {host} without --api-key: anyone who can reach it can "
                   "use the model", err=True)
    server = start_server(
        model, host=host, port=port, api_key=api_key, max_tokens=max_tokens,
        max_tokens_limit=max_tokens_limit, max_context=max_context, max_concurrent=max_concurrent,
        max_body_bytes=max_body_bytes, max_batch=max_batch, prefill_step=prefill_step,
        prompt_cache_size=prompt_cache_size, allowed_origins=allowed_origins,
        draft_model=draft_model, num_draft_tokens=num_draft_tokens, prompt_lookup=prompt_lookup,
        ngram_max=ngram_max, draft_min_confidence=draft_min_confidence,
        feature_draft=click.get_current_context().meta.get("mlxspec.draft"), shard=shard)
    if server is None:  # a follower rank: it replayed rank 0's engine until the server stopped
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    click.echo(f"mlxspec serve: {server.url}/v1 (model {server.model_id}; Ctrl-C to stop)",
               err=True)
    serve_forever(server, drain_timeout=drain_timeout)
    click.echo("mlxspec serve: stopped", err=True)
