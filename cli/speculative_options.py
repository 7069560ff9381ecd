"""The speculative decoding options shared by `generate`, `chat`, `serve` and `batch`, and the
draft model they load."""

from __future__ import annotations

import click


def parse_num_draft_tokens(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        k = int(value)
    except ValueError:
        k = 0
    if k < 1:
        raise click.BadParameter(f"{value!r}: use 'auto' or a whole number >= 1")
    return k


def speculative_options(f):
    """--draft, --draft-model, --num-draft-tokens, --prompt-lookup, --ngram-max,
    --draft-min-confidence."""
    options = [
        click.option("--draft", default="auto", show_default=True, expose_value=False,
                     callback=lambda ctx, param, v: ctx.meta.__setitem__("mlxspec.draft", v),
                     help="Feature draft, paired with prompt lookup: 'auto' (the EAGLE-3 "
                          "head shipped for this model, if any), a head's directory or Hub "
                          "id, 'mtp' (the checkpoint's own MTP layers), or 'none'."),
        click.option("--draft-model", default=None,
                     help="A smaller model sharing the tokenizer that proposes tokens."),
        click.option("--num-draft-tokens", default="auto", show_default=True,
                     callback=lambda ctx, param, v: parse_num_draft_tokens(v),
                     help="Tokens drafted per step, or 'auto' to adapt to measured speed."),
        click.option("--prompt-lookup", is_flag=True,
                     help="Draft by matching n-grams of the prompt and output (no model)."),
        click.option("--ngram-max", default=3, show_default=True, type=click.IntRange(1, 8),
                     help="Longest n-gram prompt lookup matches."),
        click.option("--draft-min-confidence", default=0.0, show_default=True,
                     type=click.FloatRange(0.0, 1.0, max_open=True),
                     help="A draft model stops drafting when its top probability falls below this."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def kv_bits_option(f):
    """--kv-bits: quantize the KV cache (single-stream decoding: `generate` and `chat`)."""
    return click.option(
        "--kv-bits", default=None, type=click.Choice(["4", "8"]),
        callback=lambda ctx, param, v: None if v is None else int(v),
        help="Quantize the KV cache to this many bits (mlx-lm's QuantizedKVCache).")(f)


def load_draft(draft_model: str | None):
    """``(model, tokenizer)`` of the draft model, loaded with mlxspec.load; without one, the
    ``--draft`` feature draft (``(FeatureDraft, None)``, built for the target by
    ``make_drafter``) or ``(None, None)``.

    The tokenizer lets the library check that the draft shares the target's tokenizer. With
    ``--shard``, the ranks other than 0 load no draft model: rank 0 alone drafts.
    """
    ctx = click.get_current_context(silent=True)
    if draft_model is None:  # a feature draft, unless prompt lookup or --draft none
        choice = ctx.meta.get("mlxspec.draft", "none") if ctx is not None else "none"
        if choice == "none" or ctx.params.get("prompt_lookup"):
            return None, None
        from mlxspec.speculative import FeatureDraft

        return FeatureDraft(choice), None
    if ctx is not None and ctx.params.get("shard") is not None:
        from mlxspec.distributed import is_primary
        from mlxspec.distributed.drafting import Rank0Draft

        if not is_primary():
            return Rank0Draft(), None
    from mlxspec.load import load

    return load(draft_model)
