"""Upload a model directory to the Hugging Face Hub with a model card that states its quality.

:func:`upload` creates the repo (optionally private) and pushes the directory's weights, config,
tokenizer and evaluation results in one commit through huggingface_hub (which handles large files,
Xet/LFS transfers and skipping content the Hub already has). The README.md it uploads is generated
by ``mlxspec.publish.card.model_card``.

Only the files that make a model are sent (config, tokenizer files, safetensors and their index,
generation config, the card, the evaluation record); anything else in the folder is refused unless
named with ``include``, and no symlink may lead out of the folder. :func:`plan_upload` checks all
of this, the evaluation record and the card locally before :func:`push` creates the repo, so a
refused upload leaves nothing on the Hub. A quantized model is refused unless its evaluation exists
and passed the quality gate; ``force`` uploads anyway and the card says so. The token comes from
``HF_TOKEN`` or ``hf auth login`` and is never printed (see ``mlxspec.redact``). Nothing in the
local directory is written, so a failed upload leaves it as it was.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxspec import __version__
from mlxspec.errors import EvaluationError, HubError, ModelNotFoundError, UnsafeUploadError
from mlxspec.evaluation.records import EVAL_FILE
from mlxspec.load import check_repo_id, read_config
from mlxspec.publish.card import model_card
from mlxspec.publish.records import CARD_FILE, evaluation_record
from mlxspec.quant.storage import quantization_record

# What makes a model, and nothing else: an api_keys.json or notes.txt beside the weights stays
# home unless named with --include.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    EVAL_FILE,
)
MODEL_PATTERNS = ("*.safetensors", "*.tiktoken")
# Never uploaded, never refused: the card is generated afresh, source.txt is a converted GGUF's
# local path (private, useless elsewhere); hidden entries (.git, .DS_Store) are local bookkeeping.
NOT_UPLOADED = (CARD_FILE, "source.txt")

# -- what is uploaded ---------------------------------------------------------------------------


def _is_model_file(name: str) -> bool:
    return name in MODEL_FILES or any(fnmatch.fnmatch(name, p) for p in MODEL_PATTERNS)


def _check_inside(path: Path, folder: Path) -> None:
    """Refuse ``path`` if it (through a symlink) leaves ``folder`` or is not a regular file."""
    target = path.resolve()
    if not target.is_relative_to(folder):
        raise UnsafeUploadError(
            f"refusing to upload {path.name}: it links to {target}, outside {folder}; copy the "
            "file into the folder (cp -L) if it belongs to the model"
        )
    if not target.is_file():
        raise UnsafeUploadError(f"refusing to upload {path.name}: it is not a regular file")


def upload_files(model_dir: Path, include: Iterable[str] = ()) -> list[Path]:
    """The files of ``model_dir`` that make the model (config, tokenizer, safetensors and index,
    generation config, evaluation record), plus the ``include``d ones, sorted.

    Raises UnsafeUploadError for any other entry not named in ``include`` (nothing is published
    by accident), and for a file whose symlink leaves the folder.
    """
    model_dir = Path(model_dir)
    folder = model_dir.resolve()
    files, unknown = [], []
    for p in sorted(model_dir.iterdir()):
        if p.name.startswith(".") or p.name in NOT_UPLOADED:
            continue
        if _is_model_file(p.name) and not p.is_dir():
            _check_inside(p, folder)
            files.append(p)
        else:
            unknown.append(p.name)
    for name in include:
        p = model_dir / name
        if not p.exists() and not p.is_symlink():
            raise UnsafeUploadError(f"--include {name}: no such file in {model_dir}")
        _check_inside(p, folder)
        if p not in files:
            files.append(p)
        unknown = [u for u in unknown if u != Path(name).parts[0]]  # (or its folder)
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise UnsafeUploadError(
            f"{model_dir} holds files that are not part of a model: {', '.join(unknown[:5])}"
            f"{more}; move them out of the folder, or name each with --include to publish it"
        )
    return sorted(files)


def check_uploadable(model_dir: Path, config: dict[str, Any], force: bool) -> str | None:
    """Raise EvaluationError if a quantized model lacks passing evaluation results (unless
    ``force``); return the reason the card must state when ``force`` overrides the check."""
    record = evaluation_record(model_dir)
    if quantization_record(config) is None:
        return None
    if record is None:
        reason = "this quantized model has no evaluation results"
        fix = "run `mlxspec eval MODEL_DIR --save` (or quantize without --no-eval)"
    elif not record.get("verdict", {}).get("passed", False):
        verdict = record.get("verdict") or {"bits": "?", "failures": ["no verdict recorded"]}
        reason = (f"its evaluation failed the {verdict['bits']}-bit quality gate "
                  f"({'; '.join(verdict.get('failures') or ['no failures listed'])})")
        fix = "re-quantize with more bits or another method"
    else:
        return None
    if force:
        return reason
    raise EvaluationError(f"refusing to upload: {reason}: {fix}, or pass --force")


@dataclass(frozen=True)
class UploadPlan:
    """Everything an upload sends, checked locally before the Hub is contacted."""

    model_dir: Path
    repo_id: str
    files: list[Path]  # uploaded under their names, beside the generated card
    card: str  # README.md for ``repo_id``
    forced_reason: str | None  # why the card carries a --force warning, or None


def plan_upload(
    model_dir: str | Path, repo_id: str, *, include: Iterable[str] = (), force: bool = False
) -> UploadPlan:
    """Check everything local (repo id, config, weights, file list, evaluation record, card)
    and return what :func:`push` would send. Contacts nothing and writes nothing.

    Raises:
        InvalidRepoIdError, ModelNotFoundError, CorruptModelError: bad id, folder or files.
        UnsafeUploadError: files that are not part of a model, or symlinks leaving the folder.
        EvaluationError: a quantized model without passing results and no ``force``, or a
            tampered evaluation record.
    """
    check_repo_id(repo_id)
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelNotFoundError(f"model directory not found: {model_dir}")
    files = upload_files(model_dir, include)  # first: nothing is read through a bad link
    config = read_config(model_dir)
    if not any(model_dir.glob("*.safetensors")):
        raise ModelNotFoundError(f"{model_dir} has no .safetensors weights to upload")
    forced_reason = check_uploadable(model_dir, config, force)
    card = model_card(model_dir, repo_id, forced_reason=forced_reason)
    return UploadPlan(model_dir, repo_id, files, card, forced_reason)


def _hub_error(error: BaseException, repo_id: str, endpoint: str) -> HubError:
    from huggingface_hub.errors import HfHubHTTPError

    from mlxspec.redact import redact

    status = getattr(getattr(error, "response", None), "status_code", None)
    detail = getattr(error, "server_message", None) or str(error)
    detail = redact((detail.strip().splitlines() or [type(error).__name__])[0])
    if not isinstance(error, HfHubHTTPError) or status is None:
        message = (f"cannot upload to {repo_id}: the Hub at {endpoint} is unreachable ({detail}); "
                   "check the network or HF_ENDPOINT")
    elif status == 401:
        message = (f"the Hub rejected the token for {repo_id} (401): set HF_TOKEN to a valid token "
                   "with write access or run `hf auth login`")
    elif status == 403:
        message = (f"no permission to write to {repo_id} (403: {detail}): use a namespace your "
                   "token can write to")
    elif status in (409, 412):
        message = (f"conflict on {repo_id} ({status}: {detail}): the repo changed or is busy; "
                   "retry, or choose another repo name")
    else:
        message = f"the Hub refused the upload to {repo_id} ({status}: {detail})"
    return HubError(message)


def _create_repo(api, repo_id: str, private: bool):
    """``(RepoUrl, created)``: the repo, and whether this call created it."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return api.create_repo(repo_id, private=private, exist_ok=False, repo_type="model"), True
    except HfHubHTTPError as e:
        if getattr(e.response, "status_code", None) != 409:
            raise
    return api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model"), False


def push(plan: UploadPlan, *, private: bool = False, commit_message: str | None = None) -> str:
    """Create the repo (if needed) and send ``plan`` in one commit; returns the repo URL."""
    import httpx2
    import huggingface_hub
    from huggingface_hub import CommitOperationAdd, HfApi

    token = huggingface_hub.get_token()
    if not token:
        raise HubError("no Hugging Face token: set HF_TOKEN or run `hf auth login` first")
    endpoint = os.environ.get("HF_ENDPOINT") or huggingface_hub.constants.ENDPOINT
    api = HfApi(endpoint=endpoint, token=token)
    repo_id, card = plan.repo_id, plan.card
    try:
        url, created = _create_repo(api, repo_id, private)
        if url.repo_id != repo_id:  # "name" became "user/name": the card names the full id
            repo_id = url.repo_id
            card = model_card(plan.model_dir, repo_id, forced_reason=plan.forced_reason)
        operations = [CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=card.encode())]
        operations += [
            CommitOperationAdd(path_in_repo=p.relative_to(plan.model_dir).as_posix(),
                               path_or_fileobj=str(p))
            for p in plan.files
        ]
        try:
            api.create_commit(
                repo_id, operations, repo_type="model",
                commit_message=commit_message
                or f"Upload {plan.model_dir.name} with mlxspec {__version__}",
            )
        except BaseException:
            if created:  # leave no empty repo behind (best effort: the Hub may be gone)
                try:
                    api.delete_repo(repo_id, repo_type="model", missing_ok=True)
                except Exception:
                    pass
            raise
    except (httpx2.HTTPError, OSError, RuntimeError, ValueError) as e:
        # HfHubHTTPError is an OSError; RuntimeError wraps failures in upload threads.
        raise _hub_error(e, repo_id, endpoint) from e
    return str(url)


def upload(
    model_dir: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    force: bool = False,
    commit_message: str | None = None,
    include: Iterable[str] = (),
) -> str:
    """Upload ``model_dir`` to the Hub model repo ``repo_id`` with a generated model card.

    Everything local is checked first (:func:`plan_upload`), so a refused upload creates no repo.

    Args:
        model_dir: a model directory (config.json, safetensors, tokenizer, mlxspec_eval.json).
        repo_id: ``"user/name"`` (or ``"name"`` in the token's own namespace).
        private: create the repo private (an existing repo keeps its visibility).
        force: upload a quantized model whose evaluation is missing or failed the gate; the card
            says so.
        include: names of extra files in ``model_dir`` to upload (anything outside the model's
            own files is refused otherwise).

    Returns:
        The URL of the repo on the Hub.

    Raises:
        EvaluationError: a quantized model without passing results and no ``force``.
        UnsafeUploadError: unknown files not named in ``include``, or symlinks out of the folder.
        HubError: bad repo id, no token, rejected token, no permission, conflict, or network.
    """
    plan = plan_upload(model_dir, repo_id, include=include, force=force)
    return push(plan, private=private, commit_message=commit_message)
