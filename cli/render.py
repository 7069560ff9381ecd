"""How results look on the terminal: every table and summary line the commands print.

Pure functions from the library's JSON-ready dicts (and reports) to text, so a command module
only parses, calls one library function and renders.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxspec.generate import Response
    from mlxspec.quantize_flow import QuantizeReport


def as_json(result: Any) -> str:
    return json.dumps(result, indent=2, default=str)


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


# -- evaluation -----------------------------------------------------------------------------------


def evaluation_table(r: dict[str, Any]) -> str:
    """The table for any :func:`mlxspec.evaluation.evaluate` result (acceptance, comparison or
    perplexity, by its keys)."""
    if "draft" in r:
        return acceptance_table(r)
    if "reference" in r:
        return comparison_table(r)
    return perplexity_table(r)


def _about(r: dict[str, Any]) -> str:
    return (f"{r['model']} on {r['text']} text: {r['windows']} windows x {r['window_tokens']} "
            f"tokens ({r['tokens']} scored)")


def perplexity_table(r: dict[str, Any]) -> str:
    return "\n".join([
        _about(r),
        f"  perplexity            {r['perplexity']:.3f} ± {r['perplexity_se']:.3f}",
        "  (no reference: pass --reference to measure the divergence from another model)",
    ])


def comparison_table(r: dict[str, Any]) -> str:
    """The comparison of a model with its reference as aligned text lines."""
    return "\n".join([
        _about(r),
        f"  reference             {r['reference']}",
        f"  perplexity            {r['perplexity']:.3f} ± {r['perplexity_se']:.3f}",
        f"  reference perplexity  {r['reference_perplexity']:.3f} ± "
        f"{r['reference_perplexity_se']:.3f}",
        f"  perplexity change     {r['perplexity_delta']:+.3f} ({r['perplexity_delta_pct']:+.2f}%)",
        f"  mean KL               {r['kl_mean']:.5f} nats/token",
        f"  p99 KL                {r['kl_p99']:.5f} nats/token",
        f"  top-1 agreement       {r['top1_agreement']:.2f}%",
    ])


def acceptance_table(r: dict[str, Any]) -> str:
    first = next(iter(r["temperatures"].values()))
    ks = [int(k) for k in first["tokens_per_pass"]]
    lines = [
        _about(r),
        f"  draft {r['draft']}: expected acceptance rate and tokens per target pass for k drafted",
        "  temp   alpha  " + "".join(f"  k={k:<3d}" for k in ks),
    ]
    for temp, row in r["temperatures"].items():
        per_k = "".join(f"  {row['tokens_per_pass'][str(k)]:5.2f}" for k in ks)
        lines.append(f"  {temp:<5s}  {row['alpha']:.3f}{per_k}")
    return "\n".join(lines)


def record_table(model: str, record: dict[str, Any]) -> str:
    """A stored evaluation record (``mlxspec_eval.json``) as the comparison table."""
    from mlxspec.evaluation.gate import verdict_line

    results = record["results"]
    row = {"model": model, "text": record["text"], "window_tokens": record["window_tokens"],
           "reference": record["reference"], **results}
    return comparison_table(row) + "\nquality gate: " + verdict_line(record["verdict"])


# -- quantize -------------------------------------------------------------------------------------


def quantize_step(step: str, report: QuantizeReport) -> str | None:
    """The lines ``mlxspec quantize`` prints as each step of ``quantize_to_dir`` ends."""
    q = report.quantization
    if step == "quantized":
        exceptions = q.get("layers") or {}
        lines = [f"mixed precision: {report.mixed}"] if report.mixed else []
        lines.append(
            f"{report.method} {report.bits}-bit, group size {report.group_size}"
            + (f", recipe {q['recipe']}" if q.get("recipe") else "")
            + (f", {len(exceptions)} layers differ (see config.json)" if exceptions else "")
            + f": {q['bits_per_weight']:.3f} bits per weight"
        )
        if "distillation" in q:
            d = q["distillation"]
            lines.append(
                f"distilled scales ({d['epochs']} epochs, {d['steps']} steps, {d['seconds']:.0f} s):"
                f" held-out KL {d['kl_before']:.4f} -> {d['kl_after']:.4f}"
                + ("" if d["kept"] else ", worse: the quantizer's scales are kept")
            )
        return "\n".join(lines)
    if step == "saved":
        return (f"wrote {report.out_dir} ({report.weight_bytes / 1e6:.1f} MB of weights, "
                f"format {report.output_format})")
    if step == "evaluated":
        from mlxspec.evaluation import EVAL_FILE

        return (record_table(str(report.out_dir), report.evaluation)
                + f" (stored in {report.out_dir / EVAL_FILE})")
    if step == "uploaded":
        return f"uploaded {report.out_dir} to {report.url}"
    return None


# -- bench ----------------------------------------------------------------------------------------


def bench_table(result: dict[str, Any]) -> str:
    """A readable table of :func:`mlxspec.benchmark.compare_decode`'s result."""
    lines = [
        f"model: {result['model']}  ({result['model_bytes'] / 1e6:.0f} MB read per token)",
        f"memory bandwidth (copy): {result['memory_bandwidth_gbs']:.1f} GB/s",
        f"{'engine':<10}{'prompt tok/s':>14}{'decode tok/s':>14}{'GB/s':>8}{'roofline':>10}",
    ]
    for name in ("mlx_lm", "mlxspec"):
        r = result[name]
        lines.append(
            f"{name:<10}{r['prompt_tps']:>14.1f}{r['generation_tps']:>14.1f}"
            f"{r['bandwidth_gbs']:>8.2f}{r['roofline']:>9.0%} "
        )
    lines.append(
        f"mlxspec / mlx-lm: decode {result['decode_ratio']:.2f}x, "
        f"prefill {result['prefill_ratio']:.2f}x"
    )
    return "\n".join(lines)


# -- doctor ---------------------------------------------------------------------------------------


def kernel_check_lines(check: dict[str, Any]) -> list[str]:
    """``mlxspec doctor --kernels``: one line per kernel case, then one per timing."""
    lines = [f"kernel check: {'all ok' if check['ok'] else 'FAILED'}"]
    for c in check["cases"]:
        what = f"  {c['path']:<13} {c['bits']}-bit g{c['group_size']:<4} {c['dtype']:<9}"
        error = c.get("error") or f"max rel error {c.get('max_rel_error', 0.0):.1e}"
        lines.append(f"{what} {'ok ' if c['ok'] else 'FAILED'}  {error}")
    for t in check.get("timing", []) + check.get("qmm_timing", []):
        lines.append(f"  time {t['path']} {t['n']}x{t['k']} {t['bits']}-bit g{t['group_size']}"
                     f" M={t['rows']}: zero-point {t['zp_us']:.0f} us ({t['zp_gbps']:.0f} GB/s),"
                     f" mx.quantized_matmul {t['affine_us']:.0f} us: {t['speedup']:.2f}x")
    if "gpu_copy_gbps" in check:
        lines.append(f"  GPU copy bandwidth: {check['gpu_copy_gbps']:.0f} GB/s")
    if "qmm_choice_saved" in check:
        lines.append(f"  zp_qmm used where it was faster; timings saved to {check['qmm_choice_saved']}")
    return lines


def report_lines(report: dict[str, Any]) -> str:
    """A nested dict as ``key: value`` lines, one level of indentation per level
    (``kernel_check`` as one line per kernel case)."""
    lines = []
    for key, value in report.items():
        if key == "kernel_check" and isinstance(value, dict):
            lines.extend(kernel_check_lines(value))
        elif isinstance(value, dict):
            lines.append(f"{key}:")
            lines.extend(f"  {k}: {v}" for k, v in value.items())
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)
