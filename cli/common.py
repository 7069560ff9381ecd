"""Options and output helpers shared by several commands."""

from __future__ import annotations

import math

import click

from mlxspec.generate import Response


def model_option(f):
    return click.option(
        "--model",
        "-m",
        default=None,
        help="Hub repo id, model directory or .gguf file (default: embedded SmolLM2-135M-Instruct).",
    )(f)


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


def stats_line(response: Response, model_bytes: int | None = None) -> str:
    """One line: prompt and generation speed, achieved bandwidth, peak memory."""
    parts = [
        f"prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tok/s",
        f"generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tok/s",
    ]
    if model_bytes:
        parts.append(f"bandwidth: {model_bytes * response.generation_tps / 1e9:.1f} GB/s")
    parts.append(f"peak memory: {response.peak_memory:.2f} GB")
    return " | ".join(parts)
