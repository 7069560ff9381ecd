"""`mlxspec upload`: push a model directory to the Hugging Face Hub with an evaluated model card."""

from __future__ import annotations

import click


@click.command("upload")
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.argument("repo")
@click.option("--private", is_flag=True, help="Create the repo private.")
@click.option("--force", is_flag=True,
              help="Upload a quantized model whose evaluation is missing or failed the quality "
                   "gate (the model card says so).")
@click.option("--message", default=None, help="Commit message.")
def command(model_dir, repo, private, force, message):
    """Upload MODEL_DIR to the Hub model repo REPO ('user/name'), with a generated model card.

    The card states the quantization, the evaluation results stored in mlxspec_eval.json, a
    recommended draft model and how to run it. A quantized model without passing evaluation
    results is refused unless --force. The token comes from HF_TOKEN or `hf auth login`;
    HF_ENDPOINT selects another Hub.

    \b
    Examples:
      mlxspec upload ./smollm2-q4 me/smollm2-q4
      mlxspec upload ./smollm2-q4 me/smollm2-q4 --private
    """
    from mlxspec.hub import upload

    url = upload(model_dir, repo, private=private, force=force, commit_message=message)
    click.echo(f"uploaded {model_dir} to {url}")
