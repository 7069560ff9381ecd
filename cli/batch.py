"""`mlxspec batch`: run a JSONL file of prompts with continuous batching, resumably."""

from __future__ import annotations

import json

import click

from mlxspec.cli.common import model_option, sampling_options, shard_option
from mlxspec.cli.speculative_options import load_draft, speculative_options


@click.command("batch")
@click.argument("prompts", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False),
              help="Results, one JSON object per line; ids already in it are skipped (resume).")
@model_option
@sampling_options
@click.option("--stop", multiple=True, help="Stop when this string is generated (repeatable).")
@click.option("--batch-size", default=None, type=click.IntRange(min=1),
              help="Sequences decoded together (default: from memory and a measured curve).")
@speculative_options
@shard_option
def command(prompts, out, model, max_tokens, temp, top_p, top_k, min_p, seed, stop, batch_size,
            draft_model, num_draft_tokens, prompt_lookup, ngram_max, draft_min_confidence,
            shard):
    """Generate a completion for every line of PROMPTS (JSONL) into --out (JSONL).

    Each line is {"id": ..., "prompt": "raw text"} or {"id": ..., "messages": [...]} (chat
    template applied), with optional max_tokens, temperature, top_p, top_k, min_p, stop, seed
    overriding the options. Results are appended as they finish: {"id", "text", "finish_reason",
    "prompt_tokens", "completion_tokens"}, or {"id", "error"} for a line that cannot run. Run the
    same command again to resume.

    \b
    Examples:
      mlxspec batch prompts.jsonl --out results.jsonl --max-tokens 128
      mlxspec batch prompts.jsonl -o results.jsonl --batch-size 16 --temp 0.7

    With --shard (under mlx.launch) rank 0 reads PROMPTS and writes --out; --batch-size
    defaults to 8 (the measured choice would differ between ranks).
    """
    import functools

    from mlxspec.distributed import agreed_decoding, is_primary, load_sharded
    from mlxspec.distributed.engine import SHARDED_BATCH_SIZE, LeadingEngine, follow_engine
    from mlxspec.serving.batch_jsonl import run_jsonl
    from mlxspec.serving.engine import Engine
    from mlxspec.speculative import make_draft

    nn_model, tokenizer = load_sharded(model, shard)
    make_engine = Engine
    if shard is not None:  # every rank decodes alike: rank 0's seed
        num_draft_tokens, seed = agreed_decoding(num_draft_tokens, seed)
        batch_size = batch_size or SHARDED_BATCH_SIZE
        make_engine = functools.partial(LeadingEngine, seed=seed)
    draft_nn, draft_tokenizer = load_draft(draft_model)
    draft = make_draft(nn_model, tokenizer, draft_model=draft_nn, draft_tokenizer=draft_tokenizer,
                       prompt_lookup=prompt_lookup, ngram_max=ngram_max,
                       min_confidence=draft_min_confidence)
    if shard is not None and not is_primary():
        follow_engine(nn_model, tokenizer, draft)  # rank 0's engine calls, until it ends
        return
    defaults = dict(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                    seed=seed, stop=tuple(stop))
    summary = run_jsonl(nn_model, tokenizer, prompts, out, defaults=defaults,
                        batch_size=batch_size, draft=draft,
                        num_draft_tokens=num_draft_tokens, make_engine=make_engine)
    click.echo(json.dumps(summary), err=True)
