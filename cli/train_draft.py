"""`mlxspec train-draft`: train an EAGLE-3 draft head for a model on its own answers, resumably."""

from __future__ import annotations

import json
import shlex
import sys

import click

from mlxspec.cli.common import model_option


@click.command("train-draft")
@model_option
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False),
              help="Directory for the trained head (EAGLE-3 layout) and its card.")
@click.option("--instructions", default=None, type=click.Path(exists=True, dir_okay=False),
              help='JSONL of {"instruction": ...} lines (default: the built-in diverse set).')
@click.option("--work", default=None, type=click.Path(file_okay=False),
              help="Where data, features and checkpoints are kept (default: OUT.train).")
@click.option("--steps", default=2000, show_default=True, type=click.IntRange(min=1),
              help="Optimizer steps in all (a rerun continues up to this).")
@click.option("--batch", default=4, show_default=True, type=click.IntRange(min=1),
              help="Answers per step.")
@click.option("--ttt-steps", default=3, show_default=True, type=click.IntRange(1, 8),
              help="Training-time-test unrolling: drafted positions trained on.")
@click.option("--lr", default=6e-4, show_default=True, type=click.FloatRange(0, 1, min_open=True),
              help="Peak learning rate (AdamW, warm-up then cosine).")
@click.option("--draft-vocab", default=8192, show_default=True, type=click.IntRange(min=16),
              help="Tokens the head scores (the target's most frequent answer tokens).")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(min=8),
              help="The longest answer generated per instruction.")
@click.option("--limit", default=None, type=click.IntRange(min=1),
              help="Use only the first N instructions.")
@click.option("--minutes", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Stop training after this long (checkpointed: rerun to continue).")
def command(model, out, instructions, work, steps, batch, ttt_steps, lr, draft_vocab,
            max_tokens, limit, minutes):
    """Train a feature draft (EAGLE-3 head) for --model and write it to --out.

    The target answers the instructions itself (batched), its hidden states at three layers
    are recorded, and a one-layer head learns to draft from them with training-time test.
    Everything is checkpointed in the work directory: run the same command again after an
    interruption to continue; nothing is lost. The head is then used with
    `mlxspec generate --draft OUT`.

    \b
    Examples:
      mlxspec train-draft --out my-head
      mlxspec train-draft --model ./my-model --out head --instructions mine.jsonl --steps 4000
    """
    from mlxspec.draft_training.flow import train_draft
    from mlxspec.draft_training.train import TrainSettings

    settings = TrainSettings(steps=steps, batch=batch, ttt_steps=ttt_steps, lr=lr)
    command_line = "mlxspec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    report = train_draft(model, out, instructions=instructions, work=work,
                         draft_vocab=draft_vocab, settings=settings, minutes=minutes,
                         max_tokens=max_tokens, limit=limit, command=command_line)
    summary = {k: report[k] for k in ("steps", "instructions", "answer_tokens", "draft_vocab")}
    summary["held_out"] = report["held_out"]
    click.echo(json.dumps(summary))
