"""What a model card states about a model directory, read from its local files only: the
evaluation record (``mlxspec_eval.json``, checked field by field so a tampered record is a clear
error, never a KeyError), the weights' sizes from the safetensors headers, and the provenance
(the source model, its license, the GGUF file it was converted from)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from mlxspec.errors import CorruptModelError, EvaluationError, MlxspecError, ModelNotFoundError
from mlxspec.evaluation import (
    EVAL_FILE,
    read_results,
    source_model,
)
from mlxspec.load import _looks_like_repo_id, default_model_path
from mlxspec.model_checks import is_number
from mlxspec.quant.storage import quantization_record as quantization

# The Hub id of the embedded default model (what its GGUF was converted from).
DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CARD_FILE = "README.md"
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4,
                     "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# The numbers of an evaluation record the card prints (mlxspec_eval.json "results", "verdict").
RESULT_NUMBERS = ("windows", "tokens", "kl_mean", "kl_p99", "top1_agreement", "perplexity",
                  "perplexity_se", "reference_perplexity", "reference_perplexity_se",
                  "perplexity_delta", "perplexity_delta_pct")
VERDICT_NUMBERS = ("bits", "max_kl", "min_top1")


def _record_problem(record: Any) -> str | None:
    """What is wrong with an evaluation record (``mlxspec_eval.json``), or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    results = record.get("results")
    if not isinstance(results, dict):
        return "no 'results' object"
    for key in RESULT_NUMBERS:
        if not is_number(results.get(key)):
            return f"results.{key} is missing or not a number"
    if "text" in record and not isinstance(record["text"], str):
        return "'text' is not a string"
    verdict = record.get("verdict")
    if verdict is None:
        return None
    if not isinstance(verdict, dict) or not isinstance(verdict.get("passed"), bool):
        return "'verdict' has no true/false 'passed'"
    for key in VERDICT_NUMBERS:
        if not is_number(verdict.get(key)):
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


def safetensors_header(path: Path) -> dict[str, Any]:
    """The tensor table of a ``.safetensors`` file: name -> {"dtype", "shape", ...} (metadata
    left out), read from its header without loading a tensor.

    Raises:
        CorruptModelError: the header is unreadable or a tensor has no valid shape.
    """
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
        tensors.update(safetensors_header(path))
    q = quantization(config) or {}
    n_bytes = n_weights = 0
    for name, info in tensors.items():
        shape = info["shape"]
        numel = 1
        for d in shape:
            numel *= d
        n_bytes += numel * SAFETENSORS_BYTES.get(info.get("dtype"), 4)
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
        return _recorded_source(model_dir)
    if spec in ("default", "None"):
        try:
            return default_model_path()
        except ModelNotFoundError:
            return None
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return path
    return _recorded_source(path)


def _recorded_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory records in source.txt (None if unreadable)."""
    record = model_dir / "source.txt"
    try:
        text = record.read_text(encoding="utf-8").strip() if record.is_file() else ""
    except (OSError, UnicodeDecodeError):
        return None
    return Path(text) if text else None


def provenance(model_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    """``{"base_model": hub id or None, "license": id or None}`` for the card, from (in order) the
    directory's own README metadata, the source model's README or GGUF metadata, and the
    embedded default's known Hub id."""
    own = _front_matter(model_dir / CARD_FILE)
    base, license_ = own.get("base_model"), own.get("license")
    spec = source_model(config)
    spec = spec if isinstance(spec, str) and spec else None
    if spec and _looks_like_repo_id(spec) and not Path(spec).exists():
        base = base or spec
    elif spec and Path(spec).expanduser().is_dir():
        source = _front_matter(Path(spec).expanduser() / CARD_FILE)
        base = base or source.get("base_model")
        license_ = license_ or source.get("license")
    gguf = _gguf_of(spec, model_dir)
    if gguf is not None and gguf.is_file():
        from mlxspec.gguf.convert import read_gguf

        try:
            license_ = license_ or read_gguf(gguf).metadata.get("general.license")
        except MlxspecError:  # not a readable GGUF after all: the card just has no license
            pass
        try:
            if gguf.resolve() == default_model_path().resolve():
                base = base or DEFAULT_BASE_MODEL
        except ModelNotFoundError:
            pass
    if isinstance(base, list):
        base = base[0] if base else None
    return {"base_model": base if isinstance(base, str) else None,
            "license": license_ if isinstance(license_, str) else None}


