"""`mlxspec upload`: push a model directory to the Hugging Face Hub with an evaluated model card."""

from __future__ import annotations

import click


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


@click.command("upload")
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.argument("repo")
@click.option("--private", is_flag=True, help="Create the repo private.")
@click.option("--force", is_flag=True,
              help="Upload a quantized model whose evaluation is missing or failed the quality "
                   "gate (the model card says so).")
@click.option("--include", multiple=True, metavar="FILE",
              help="Also upload FILE from MODEL_DIR (repeatable); other files that are not part "
                   "of a model are refused.")
@click.option("--dry-run", is_flag=True, help="Check everything and list the files; send nothing.")
@click.option("--message", default=None, help="Commit message.")
def command(model_dir, repo, private, force, include, dry_run, message):
    """Upload MODEL_DIR to the Hub model repo REPO ('user/name'), with a generated model card.

    Only the model's own files are sent: config, tokenizer files, safetensors (and index),
    generation config, the evaluation record mlxspec_eval.json and the generated README.md card.
    Any other file is refused unless named with --include; symlinks leading out of MODEL_DIR are
    refused. The card states the quantization, the evaluation results, a recommended draft model
    and how to run it. A quantized model without passing evaluation results is refused unless
    --force. The token comes from HF_TOKEN or `hf auth login` and is never printed; HF_ENDPOINT
    selects another Hub.

    \b
    Examples:
      mlxspec upload ./smollm2-q4 me/smollm2-q4 --dry-run
      mlxspec upload ./smollm2-q4 me/smollm2-q4 --private
    """
    from mlxspec.publish.hub import CARD_FILE, plan_upload, push

    plan = plan_upload(model_dir, repo, include=include, force=force)
    visibility = "private" if private else "public unless the repo exists"
    click.echo(f"{'would upload' if dry_run else 'uploading'} to {plan.repo_id} ({visibility}):")
    click.echo(f"  {CARD_FILE}  ({_size(len(plan.card.encode()))}, generated)")
    for p in plan.files:
        click.echo(f"  {p.relative_to(plan.model_dir).as_posix()}  ({_size(p.stat().st_size)})")
    if dry_run:
        click.echo("dry run: nothing was sent")
        return
    url = push(plan, private=private, commit_message=message)
    click.echo(f"uploaded {model_dir} to {url}")
