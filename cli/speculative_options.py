"""The speculative decoding options and text-input checks shared by `generate` and `chat`."""

from __future__ import annotations

import click

from mlxspec.errors import InvalidArgumentError


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
    """--draft-model, --num-draft-tokens, --prompt-lookup, --ngram-max, --draft-min-confidence."""
    options = [
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


def read_text(data: bytes, where: str) -> str:
    """``data`` decoded as UTF-8, or ``InvalidArgumentError`` naming ``where``."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(
            f"{where} is not valid UTF-8 (byte {e.start}): convert it to UTF-8 first"
        ) from None


def check_text(text: str, where: str) -> str:
    """``text`` if it is valid Unicode; undecodable bytes of an argument (surrogate escapes on
    POSIX) raise ``InvalidArgumentError`` naming ``where``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(
            f"{where} is not valid UTF-8 (character {e.start}): convert it to UTF-8 first"
        ) from None
    return text


class PrefillProgress:
    """A progress bar (stderr) for prompts long enough to take a while to prefill; a
    ``prompt_progress_callback``. Use as a context manager."""

    def __init__(self, min_tokens: int = 2048, enabled: bool = True):
        self.min_tokens, self.enabled, self.progress, self.task = min_tokens, enabled, None, None

    def __call__(self, done: int, total: int) -> None:
        if self.progress is None and self.enabled and total >= self.min_tokens and done < total:
            from rich.console import Console
            from rich.progress import Progress

            self.progress = Progress(console=Console(stderr=True), transient=True)
            self.progress.start()
            self.task = self.progress.add_task("prefill", total=total)
        if self.progress is not None:
            self.progress.update(self.task, completed=done)
            if done >= total:
                self.close()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def __enter__(self) -> PrefillProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_draft(draft_model: str | None):
    """``(model, tokenizer)`` of the draft model, loaded with mlxspec.load, or ``(None, None)``.

    The tokenizer lets the library check that the draft shares the target's tokenizer.
    """
    if draft_model is None:
        return None, None
    from mlxspec.load import load

    return load(draft_model)
