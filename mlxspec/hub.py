"""Upload a model directory to the Hugging Face Hub with a model card that states its quality.

:func:`upload` creates the repo (optionally private) and pushes the directory's weights, config,
tokenizer and evaluation results in one commit through huggingface_hub (which handles large files,
Xet/LFS transfers and skipping content the Hub already has). The README.md it uploads is generated
by :func:`model_card`: YAML metadata (``library_name: mlx``, tags, ``base_model``, ``pipeline_tag``,
the source's license), the quantization (method, bits, group size, format, bits per weight, size
on disk), the evaluation table from ``mlxspec_eval.json``, a recommended draft model when the
recipes know one, and usage snippets.

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
import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxspec import __version__
from mlxspec.errors import (
    CorruptModelError,
    EvaluationError,
    HubError,
    ModelNotFoundError,
    UnsafeUploadError,
)
from mlxspec.eval import BUILTIN_TEXT_TITLE, EVAL_FILE, read_results, source_model, verdict_line
from mlxspec.load import _looks_like_repo_id, check_repo_id, default_model_path, read_config

# The Hub id of the embedded default model (what its GGUF was converted from).
DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CARD_FILE = "README.md"
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
# config.json["quantization"]["format"] values that plain mlx-lm loads (mlx-lm writes no format).
MLX_LM_FORMATS = (None, "affine", "mlx")
FORMAT_DESCRIPTIONS = {
    "zp": "mlxspec zero-point `zp`: w = s * (q - z), a float scale and an integer zero-point per "
          "group",
    **{name: "mlx-lm affine: w = scale * q + bias, a float scale and bias per group"
       for name in MLX_LM_FORMATS},
}
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4,
                     "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# The numbers of an evaluation record the card prints (mlxspec_eval.json "results", "verdict").
RESULT_NUMBERS = ("windows", "tokens", "kl_mean", "kl_p99", "top1_agreement", "perplexity",
                  "perplexity_se", "reference_perplexity", "reference_perplexity_se",
                  "perplexity_delta", "perplexity_delta_pct")
VERDICT_NUMBERS = ("bits", "max_kl", "min_top1")


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
        unknown = [u for u in unknown if u != name]
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise UnsafeUploadError(
            f"{model_dir} holds files that are not part of a model: {', '.join(unknown[:5])}"
            f"{more}; move them out of the folder, or name each with --include to publish it"
        )
    return sorted(files)


def quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``quantization`` entry of a config, or None for an unquantized model."""
    q = config.get("quantization") or config.get("quantization_config")
    return q if isinstance(q, dict) else None


def _safetensors_header(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > path.stat().st_size:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        header.pop("__metadata__", None)
        for name, info in header.items():
            shape = info.get("shape") if isinstance(info, dict) else None
            if not isinstance(shape, list) or not all(
                isinstance(d, int) and d >= 0 for d in shape
            ):
                raise ValueError(f"tensor {name} has no valid shape")
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        raise CorruptModelError(f"{path} is not a readable safetensors file ({e})") from None
    return header


def weight_stats(model_dir: Path, config: dict[str, Any]) -> dict[str, float]:
    """Size on disk (bytes) and bits per weight of the safetensors in ``model_dir``.

    Bits per weight = all tensor bytes (packed weights, scales, zero-points/biases, norms,
    embeddings) * 8 / the number of weights the unquantized model has. A packed ``uint32`` weight
    with a ``scales`` sibling holds ``32 / bits`` weights per word.
    """
    tensors: dict[str, dict] = {}
    size = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        size += path.stat().st_size
        tensors.update(_safetensors_header(path))
    q = quantization(config) or {}
    n_bytes = n_weights = 0
    for name, info in tensors.items():
        shape = info["shape"]
        numel = 1
        for d in shape:
            numel *= d
        n_bytes += numel * SAFETENSORS_BYTES.get(info["dtype"], 4)
        prefix = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and f"{prefix}.scales" in tensors:
            layer = q.get(prefix) or (q.get("layers") or {}).get(prefix)
            layer = layer if isinstance(layer, dict) else {}
            bits = layer.get("bits", q.get("bits"))
            n_weights += numel * 32 // bits if isinstance(bits, int) and bits > 0 else numel
        elif not name.endswith((".scales", ".biases", ".zeros")):
            n_weights += numel
    return {"size_bytes": size, "bits_per_weight": 8 * n_bytes / n_weights if n_weights else 0.0}


# -- provenance: base model and license ---------------------------------------------------------


def _front_matter(readme: Path) -> dict[str, Any]:
    import yaml

    if not readme.is_file():
        return {}
    text = readme.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return {}
    block = text[3:].split("\n---", 1)[0]
    try:
        data = yaml.safe_load(block)
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _gguf_of(spec: str | None, model_dir: Path) -> Path | None:
    """The GGUF file a model came from: the spec itself, or a converted directory's record."""
    if spec is None:
        record = model_dir / "source.txt"
        return Path(record.read_text().strip()) if record.is_file() else None
    if spec in ("default", "None"):
        try:
            return default_model_path()
        except ModelNotFoundError:
            return None
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return path
    if (path / "source.txt").is_file():
        return Path((path / "source.txt").read_text().strip())
    return None


def provenance(model_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    """``{"base_model": hub id or None, "license": id or None}`` for the card, from (in order) the
    directory's own README metadata, the source model's README or GGUF metadata, and the
    embedded default's known Hub id."""
    own = _front_matter(model_dir / CARD_FILE)
    base, license_ = own.get("base_model"), own.get("license")
    spec = source_model(config)
    if spec and _looks_like_repo_id(spec) and not Path(spec).exists():
        base = base or spec
    elif spec and Path(spec).expanduser().is_dir():
        source = _front_matter(Path(spec).expanduser() / CARD_FILE)
        base = base or source.get("base_model")
        license_ = license_ or source.get("license")
    gguf = _gguf_of(spec, model_dir)
    if gguf is not None and gguf.is_file():
        from mlxspec.gguf import read_gguf

        license_ = license_ or read_gguf(gguf).metadata.get("general.license")
        try:
            if gguf.resolve() == default_model_path().resolve():
                base = base or DEFAULT_BASE_MODEL
        except ModelNotFoundError:
            pass
    if isinstance(base, list):
        base = base[0] if base else None
    return {"base_model": base, "license": license_}


def recommended_draft(base_model: str | None) -> dict[str, Any] | None:
    """From the recipes: ``{"draft": id}`` when ``base_model`` is a known target, or
    ``{"targets": [ids]}`` when it is itself a known draft."""
    if base_model is None:
        return None
    from mlxspec.catalog import known_pairs

    pairs = known_pairs()
    for pair in pairs:
        if pair["target"] == base_model:
            return {"draft": pair["draft"]}
    targets = [pair["target"] for pair in pairs if pair["draft"] == base_model]
    return {"targets": targets} if targets else None


# -- the model card -----------------------------------------------------------------------------


def _quantization_section(model_dir: Path, config: dict[str, Any]) -> list[str]:
    q = quantization(config)
    stats = weight_stats(model_dir, config)
    size = f"{stats['size_bytes'] / 1e6:.1f} MB"
    if q is None:
        return ["## Weights", "", f"Unquantized: {stats['bits_per_weight']:.2f} bits per weight, "
                f"{size} on disk.", ""]
    fmt = q.get("format")
    rows = [
        ("method", q.get("method") or "round-to-nearest (mlx-lm affine)"),
        ("bits", q.get("bits")),
        ("group size", q.get("group_size")),
        ("format", FORMAT_DESCRIPTIONS.get(fmt, fmt)),
        ("calibration", _calibration(q)),
        ("bits per weight", f"{q.get('bits_per_weight') or stats['bits_per_weight']:.3f}"),
        ("size on disk", size),
    ]
    lines = ["## Quantization", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows if v is not None]
    return lines + [""]


def _calibration(q: dict[str, Any]) -> str | None:
    if not q.get("calibration"):
        return None
    text = ("mlxspec's built-in public-domain text" if q["calibration"] == "builtin"
            else f"`{q['calibration']}`")
    size = (f", {q['calibration_windows']} windows of {q['calibration_window_tokens']} tokens"
            if q.get("calibration_windows") else "")
    return text + size


def _evaluation_section(record: dict[str, Any] | None, forced_reason: str | None) -> list[str]:
    lines = ["## Evaluation", ""]
    if forced_reason:
        lines += [f"> **Warning:** uploaded with `--force`: {forced_reason}.", ""]
    if record is None:
        return lines + ["No evaluation results were stored with this model.", ""]
    r = record["results"]
    text = record.get("text", "builtin")
    text = (f"mlxspec's built-in held-out text ({BUILTIN_TEXT_TITLE})" if text == "builtin"
            else f"`{Path(text).name}`")
    lines += [
        f"Measured by `mlxspec eval` against the unquantized source model on the same "
        f"{r['windows']} windows of {record.get('window_tokens', '?')} tokens ({r['tokens']} "
        f"scored tokens) of {text}.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| mean KL divergence (nats/token) | {r['kl_mean']:.5f} |",
        f"| 99th-percentile KL (nats/token) | {r['kl_p99']:.5f} |",
        f"| same top-1 token as the source | {r['top1_agreement']:.2f}% |",
        f"| perplexity | {r['perplexity']:.3f} ± {r['perplexity_se']:.3f} |",
        f"| source perplexity | {r['reference_perplexity']:.3f} ± "
        f"{r['reference_perplexity_se']:.3f} |",
        f"| perplexity change | {r['perplexity_delta']:+.3f} ({r['perplexity_delta_pct']:+.2f}%) |",
        "",
    ]
    if record.get("verdict"):
        lines += [f"Quality gate: **{verdict_line(record['verdict'])}**", ""]
    return lines


def _draft_section(base_model: str | None) -> list[str]:
    rec = recommended_draft(base_model)
    if rec is None:
        return []
    if "draft" in rec:
        text = (f"Recommended draft model for speculative decoding: `{rec['draft']}` (same "
                "tokenizer); quantize it too for the fastest drafts.")
    else:
        text = ("This model is a known draft for speculative decoding with "
                + ", ".join(f"`{t}`" for t in rec["targets"]) + " (same tokenizer).")
    return ["## Speculative decoding", "", text, ""]


def _usage_section(repo_id: str, config: dict[str, Any], draft: str | None) -> list[str]:
    q = quantization(config)
    lines = [
        "## Use with mlxspec", "",
        "```bash", "pip install mlxspec", f"mlxspec chat --model {repo_id}",
    ]
    if draft:
        lines.append(f"mlxspec chat --model {repo_id} --draft-model {draft}")
    lines += [
        "```", "",
        "```python",
        "from mlxspec import generate, load",
        "",
        f'model, tokenizer = load("{repo_id}")',
        'print(generate(model, tokenizer, "Write a haiku about the sea", max_tokens=64))',
        "```", "",
    ]
    if q is None or q.get("format") in MLX_LM_FORMATS:
        lines += [
            "## Use with mlx-lm", "",
            "```bash", "pip install mlx-lm",
            f'mlx_lm.generate --model {repo_id} --prompt "Write a haiku about the sea"',
            "```", "",
        ]
    else:
        lines += [f"The `{q.get('format')}` format needs mlxspec's loader: plain mlx-lm cannot "
                  "load these weights.", ""]
    return lines


def model_card(
    model_dir: str | Path, repo_id: str, *, forced_reason: str | None = None
) -> str:
    """The README.md (YAML metadata + markdown) to upload with the model in ``model_dir``."""
    from huggingface_hub import ModelCardData

    model_dir = Path(model_dir)
    config = read_config(model_dir)
    q = quantization(config)
    origin = provenance(model_dir, config)
    base = origin["base_model"]
    tags = ["mlx", "mlxspec"] + ([f"{q.get('bits')}-bit", "quantized"] if q else [])
    data = ModelCardData(
        library_name="mlx",
        pipeline_tag="text-generation",
        license=origin["license"],
        base_model=base,
        base_model_relation="quantized" if q and base else None,
        tags=tags,
    )
    rec = recommended_draft(base)
    title = repo_id.split("/")[-1]
    about = (f"[{repo_id}](https://huggingface.co/{repo_id}) is "
             + (f"{'an' if q.get('bits') == 8 else 'a'} {q.get('bits')}-bit quantization"
                if q else "an MLX conversion")
             + (f" of [{base}](https://huggingface.co/{base})" if base else "")
             + f", made with mlxspec {__version__}.")
    lines = [f"# {title}", "", about, ""]
    lines += _quantization_section(model_dir, config)
    record = evaluation_record(model_dir)
    if q is not None or record is not None:
        lines += _evaluation_section(record, forced_reason)
    lines += _draft_section(base)
    lines += _usage_section(repo_id, config, rec.get("draft") if rec else None)
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)


# -- the upload ---------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _record_problem(record: Any) -> str | None:
    """What is wrong with an evaluation record (``mlxspec_eval.json``), or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    results = record.get("results")
    if not isinstance(results, dict):
        return "no 'results' object"
    for key in RESULT_NUMBERS:
        if not _is_number(results.get(key)):
            return f"results.{key} is missing or not a number"
    if "text" in record and not isinstance(record["text"], str):
        return "'text' is not a string"
    verdict = record.get("verdict")
    if verdict is None:
        return None
    if not isinstance(verdict, dict) or not isinstance(verdict.get("passed"), bool):
        return "'verdict' has no true/false 'passed'"
    for key in VERDICT_NUMBERS:
        if not _is_number(verdict.get(key)):
            return f"verdict.{key} is missing or not a number"
    failures = verdict.get("failures", [])
    if not isinstance(failures, list) or not all(isinstance(f, str) for f in failures):
        return "verdict.failures is not a list of strings"
    return None


def evaluation_record(model_dir: Path) -> dict[str, Any] | None:
    """The model's evaluation record, checked field by field; None when it has none.

    Raises EvaluationError naming the bad field, so a tampered or truncated record stops the
    upload before anything reaches the Hub.
    """
    record = read_results(model_dir)
    if record is None:
        return None
    problem = _record_problem(record)
    if problem:
        raise EvaluationError(
            f"{Path(model_dir) / EVAL_FILE} is not a valid evaluation record ({problem}): "
            f"re-run `mlxspec eval {model_dir} --save`"
        )
    return record


def check_uploadable(model_dir: Path, config: dict[str, Any], force: bool) -> str | None:
    """Raise EvaluationError if a quantized model lacks passing evaluation results (unless
    ``force``); return the reason the card must state when ``force`` overrides the check."""
    record = evaluation_record(model_dir)
    if quantization(config) is None:
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
