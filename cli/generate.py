"""`mlxspec generate`: stream a completion for one prompt."""

from __future__ import annotations

import json
import sys

import click

from mlxspec.cli.common import (
    check_text,
    model_option,
    read_text,
    sampling_options,
    shard_option,
)
from mlxspec.cli.render import PrefillProgress, stats_line
from mlxspec.cli.speculative_options import kv_bits_option, load_draft, speculative_options


@click.command("generate")
@model_option
@click.option("--prompt", "-p", default="Tell me a short story about a robot who learns to paint.",
              show_default=True, help="The prompt; '-' reads it from standard input.")
@click.option("--system", default=None, help="System prompt (with the chat template).")
@click.option("--no-chat-template", is_flag=True, help="Feed the prompt as raw text.")
@click.option("--stop", multiple=True, help="Stop when this string is generated (repeatable).")
@click.option("--max-kv-size", default=None, type=click.IntRange(min=16),
              help="Keep at most this many tokens in a rotating KV cache.")
@sampling_options
@speculative_options
@kv_bits_option
@shard_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON result instead of streaming.")
@click.option("--json-schema", default=None, metavar="FILE",
              help="Answer only JSON valid under this JSON schema (constrained decoding).")
def command(model, prompt, system, no_chat_template, stop, max_kv_size, max_tokens, temp, top_p,
            top_k, min_p, seed, draft_model, num_draft_tokens, prompt_lookup, ngram_max,
            draft_min_confidence, kv_bits, shard, as_json, json_schema):
    """Generate text from a prompt, streaming it, then print speed and memory statistics.

    \b
    Examples:
      mlxspec generate --prompt "What is the capital of France?"
      mlxspec generate -m model.gguf -p "Once upon a time" --no-chat-template --temp 0.7
      mlxspec generate --prompt-lookup -p "Add a docstring to: def f(x): return x*2"
      echo "Explain DNS" | mlxspec generate -p - --json
      mlxspec generate -p "A person as JSON" --json-schema person.schema.json
    """
    from mlxspec.benchmark import model_bytes
    from mlxspec.chat_template import chat_prompt
    from mlxspec.distributed import agreed_decoding, group_report, load_sharded
    from mlxspec.generate import stream_generate
    from mlxspec.grammar import read_json_schema, schema_processor
    from mlxspec.quant.kernels import EMULATED, emulating

    prompt = read_text(sys.stdin.buffer.read(), "standard input") if prompt == "-" else prompt
    check_text(prompt, "--prompt")
    if system is not None:
        check_text(system, "--system")
    schema = read_json_schema(json_schema) if json_schema is not None else None
    nn_model, tokenizer = load_sharded(model, shard)
    if shard is not None:  # every rank samples alike: rank 0's seed
        num_draft_tokens, seed = agreed_decoding(num_draft_tokens, seed)
    processors = [schema_processor(tokenizer, schema)] if json_schema is not None else None
    draft, draft_tokenizer = load_draft(draft_model)
    if tokenizer.chat_template and not no_chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        prompt = chat_prompt(tokenizer, messages)
    text, last = "", None
    with PrefillProgress(enabled=not as_json) as progress:
        for last in stream_generate(
            nn_model, tokenizer, prompt, max_tokens=max_tokens, temp=temp, top_p=top_p,
            top_k=top_k, min_p=min_p, seed=seed, stop=stop, max_kv_size=max_kv_size,
            draft_model=draft, draft_tokenizer=draft_tokenizer,
            num_draft_tokens=num_draft_tokens, prompt_lookup=prompt_lookup,
            ngram_max=ngram_max, draft_min_confidence=draft_min_confidence, kv_bits=kv_bits,
            prompt_progress_callback=progress, logits_processors=processors,
        ):
            text += last.text
            if not as_json:
                click.echo(last.text, nl=False)
    nbytes = model_bytes(nn_model)
    if as_json:
        result = last.as_dict(text, nbytes)
        if emulating():  # MLXSPEC_KERNELS=emulate: none of these speeds is a Metal one
            result["kernels"] = EMULATED
        if shard is not None:
            result["group"] = {**group_report(), "layout": nn_model.shard_layout}
        click.echo(json.dumps(result, indent=2))
        return
    click.echo()
    click.echo(stats_line(last, nbytes), err=True)
    if last.spec_stats is not None:
        click.echo(last.spec_stats.summary(), err=True)
