"""The model card (README.md) mlxspec uploads with a model: it states the model's quality.

:func:`model_card` writes YAML metadata (``library_name: mlx`` when mlx-lm loads the weights,
tags, ``base_model``, ``pipeline_tag``, the source's license), the quantization (method, bits,
group size, format, bits per weight, size on disk, which tools load it), the evaluation table from ``mlxspec_eval.json`` (checked field by field
by :func:`evaluation_record`: a tampered record is a clear error, never a KeyError), a recommended
draft model when the recipes know one, and usage snippets. Everything here reads local files only.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from mlxspec import __version__
from mlxspec.errors import CorruptModelError, EvaluationError, MlxspecError, ModelNotFoundError
from mlxspec.evaluation import (
    BUILTIN_TEXT_TITLE,
    EVAL_FILE,
    read_results,
    source_model,
    verdict_line,
)
from mlxspec.load import _looks_like_repo_id, default_model_path, read_config
from mlxspec.model_checks import is_number
from mlxspec.quant.storage import mlx_lm_loadable
from mlxspec.quant.storage import quantization_record as quantization

# The Hub id of the embedded default model (what its GGUF was converted from).
DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CARD_FILE = "README.md"
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
        from mlxspec.gguf import read_gguf

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
        ("method", _method(q)),
        ("bits", q.get("bits")),
        ("group size", q.get("group_size")),
        ("format", FORMAT_DESCRIPTIONS.get(fmt, fmt)),
        ("calibration", _calibration(q)),
        ("bits per weight", f"{_bits_per_weight(q, stats):.3f}"),
        ("size on disk", size),
    ]
    rows.append(("loads in", mlx_lm_loadable(config)[1]))
    lines = ["## Quantization", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows if v is not None]
    return lines + [""]


def _method(q: dict[str, Any]) -> str:
    """The method's name, and the blocks awq+gptq had to leave without AWQ's scales."""
    method = q.get("method") or "round-to-nearest (mlx-lm affine)"
    unscaled = q.get("awq_unscaled_blocks")
    if isinstance(unscaled, list) and unscaled:
        method += f" (plain GPTQ where AWQ's scales could not be folded: {', '.join(unscaled)})"
    distilled = q.get("distillation")
    if isinstance(distilled, dict):
        method += (f", then scales distilled from the source ({distilled.get('epochs')} epochs,"
                   f" held-out KL {distilled.get('kl_before')} -> {distilled.get('kl_after')}"
                   + ("" if distilled.get("kept") else "; not kept: it was worse") + ")")
    return method


def _bits_per_weight(q: dict[str, Any], stats: dict[str, float]) -> float:
    recorded = q.get("bits_per_weight")
    return recorded if is_number(recorded) and recorded > 0 else stats["bits_per_weight"]


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
    loadable, reason = mlx_lm_loadable(config)
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
    if loadable:
        lines += [
            "## Use with mlx-lm", "",
            "```bash", "pip install mlx-lm",
            f'mlx_lm.generate --model {repo_id} --prompt "Write a haiku about the sea"',
            "```", "",
        ]
    else:
        lines += [f"Plain mlx-lm cannot load these weights: {reason}.", ""]
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
    loadable = mlx_lm_loadable(config)[0]
    tags = (["mlx"] if loadable else []) + ["mlxspec"]
    tags += [f"{q.get('bits')}-bit", "quantized"] if q else []
    data = ModelCardData(
        library_name="mlx" if loadable else None,  # the Hub's "Use in MLX" means mlx-lm
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


