"""The model card (README.md) mlxspec uploads with a model: it states the model's quality.

:func:`model_card` writes YAML metadata (``library_name: mlx`` when mlx-lm loads the weights,
tags, ``base_model``, ``pipeline_tag``, the source's license), the quantization (method, bits,
group size, format, bits per weight, size on disk, which tools load it), the evaluation table from ``mlxspec_eval.json`` (checked field by field
by :func:`evaluation_record`: a tampered record is a clear error, never a KeyError), a recommended
draft model when the recipes know one, and usage snippets. Everything here reads local files only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxspec import __version__
from mlxspec.evaluation import (
    BUILTIN_TEXT_TITLE,
    verdict_line,
)
from mlxspec.load import read_config
from mlxspec.model_checks import is_number
from mlxspec.publish.records import (
    evaluation_record,
    provenance,
    weight_stats,
)
from mlxspec.quant.storage import mlx_lm_loadable
from mlxspec.quant.storage import quantization_record as quantization

# config.json["quantization"]["format"] values that plain mlx-lm loads (mlx-lm writes no format).
MLX_LM_FORMATS = (None, "affine", "mlx")
FORMAT_DESCRIPTIONS = {
    "zp": "mlxspec zero-point `zp`: w = s * (q - z), a float scale and an integer zero-point per "
          "group",
    **{name: "mlx-lm affine: w = scale * q + bias, a float scale and bias per group"
       for name in MLX_LM_FORMATS},
}
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


