"""Options shared by several commands (output rendering lives in :mod:`mlxspec.cli.render`).

Imports nothing heavy: every command module is imported for ``mlxspec --help``.
"""

from __future__ import annotations

import functools
import math

import click

from mlxspec.errors import InvalidArgumentError


def model_option(f):
    return click.option(
        "--model",
        "-m",
        default=None,
        help="Hub repo id, model directory or .gguf file (default: embedded SmolLM2-135M-Instruct).",
    )(f)


def shard_option(f):
    """``--shard tensor|pipeline``: the command (run under ``mlx.launch``) gets ``shard`` and runs
    inside :func:`mlxspec.distributed.sharded_run` (a lost rank is one ``error:`` line)."""

    @functools.wraps(f)
    def run(*args, **kwargs):
        if kwargs.get("shard") is None:
            return f(*args, **kwargs)
        from mlxspec.distributed import sharded_run

        with sharded_run(kwargs["shard"]):
            return f(*args, **kwargs)

    return click.option(
        "--shard", type=click.Choice(["tensor", "pipeline"]), default=None,
        help="Shard the model over the processes of `mlx.launch` (see docs/distributed.md).",
    )(run)


def _finite(ctx, param, value):
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value!r} is not a finite number")
    return value


def sampling_options(f):
    """--max-tokens, --temp, --top-p, --top-k, --min-p, --seed."""
    options = [
        click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(min=1)),
        click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
                     callback=_finite, help="Sampling temperature; 0 is greedy."),
        click.option("--top-p", default=1.0, show_default=True, callback=_finite,
                     type=click.FloatRange(0.0, 1.0, min_open=True)),
        click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0),
                     help="Keep the k most likely tokens; 0 keeps all."),
        click.option("--min-p", default=0.0, show_default=True, type=click.FloatRange(0.0, 1.0),
                     callback=_finite),
        click.option("--seed", default=None, type=click.IntRange(0, 2**63 - 1),
                     help="Seed for reproducible sampling (0 to 2**63 - 1)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def gate_options(f):
    """--max-kl and --min-top1: the quality gate's thresholds (defaults depend on the bits)."""
    options = [
        click.option("--max-kl", type=click.FloatRange(min=0.0), default=None,
                     help="Gate: highest mean KL divergence in nats/token (default: 0.01 at 8 "
                          "bits, 0.10 at 4 bits and below)."),
        click.option("--min-top1", type=click.FloatRange(0.0, 100.0), default=None,
                     help="Gate: lowest same-top-1 agreement in % (default: 97 at 8 bits, 88 "
                          "at 4 bits and below)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


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
