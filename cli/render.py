"""How results look on the terminal: every table and summary line the commands print.

Pure functions from the library's JSON-ready dicts (and reports) to text, so a command module
only parses, calls one library function and renders.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxspec.generate import Response
    from mlxspec.publish.quantize_flow import QuantizeReport


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
    from mlxspec.quant.kernels import EMULATED, emulating

    if emulating():  # MLXSPEC_KERNELS=emulate: these speeds are the CPU emulator's
        parts.append(f"kernels {EMULATED}")
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
    ]) + domains_table(r)


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
    ]) + domains_table(r)


def domains_table(r: dict[str, Any]) -> str:
    """The per-domain lines of a built-in evaluation and its worst domain ('' without them)."""
    domains = r.get("domains")
    if not domains:
        return ""
    if "worst" not in r:  # perplexity alone
        return "\n" + "\n".join(f"  {d:<10} perplexity {x['perplexity']:.3f} ± "
                                 f"{x['perplexity_se']:.3f}" for d, x in domains.items())
    lines = ["", "  domain            mean KL   p99 KL   top-1   ppl (reference)"]
    rows = [*domains.items(), (f"worst: {r['worst']['domain']}", r["worst"])]
    for d, x in rows:
        lines.append(f"  {d:<16} {x['kl_mean']:8.5f} {x['kl_p99']:8.4f} {x['top1_agreement']:6.2f}%"
                     f"  {x['perplexity']:.2f} ({x['reference_perplexity']:.2f})")
    return "\n".join(lines)


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
    for name in ("mlx_lm", "mlxspec", "draft"):
        if name not in result:
            continue
        r = result[name]
        lines.append(
            f"{name:<10}{r['prompt_tps']:>14.1f}{r['generation_tps']:>14.1f}"
            f"{r['bandwidth_gbs']:>8.2f}{r['roofline']:>9.0%} "
        )
    lines.append(
        f"mlxspec / mlx-lm: decode {result['decode_ratio']:.2f}x, "
        f"prefill {result['prefill_ratio']:.2f}x"
    )
    if "draft" in result:  # GB/s and roofline of the draft row: the target's bytes per token
        lines.append(
            f"draft / mlxspec: decode {result['draft_ratio']:.2f}x, "
            f"{result['draft'].get('tokens_per_pass', 0):.2f} tokens per target pass"
        )
    if result.get("emulated"):  # MLXSPEC_KERNELS=emulate: no number here is a Metal speed
        lines = [f"{line}  [kernels {result['emulated']}]" for line in lines]
    return "\n".join(lines)


# -- doctor ---------------------------------------------------------------------------------------


def kernel_check_lines(check: dict[str, Any]) -> list[str]:
    """``mlxspec doctor --kernels``: one line per kernel case, then one per timed row; under
    ``MLXSPEC_KERNELS=emulate`` every line says so."""
    tag = " [emulated]" if check.get("emulated") else ""
    lines = [f"kernel check: {'all ok' if check['ok'] else 'FAILED'}"
             + (f" ({check['emulated']})" if tag else "")
             + (f" on {check['device']}, MLX {check['mlx']}" if check.get("device") else "")]
    for c in check["cases"]:
        scales = f" scales {c['scale_dtype']}" if c.get("scale_dtype", c["dtype"]) != c["dtype"] else ""
        what = f"  {c['path']:<30} {c['bits']}-bit g{c['group_size']:<4} {c['dtype']:<9}{scales}"
        error = c.get("error") or f"max rel error {c.get('max_rel_error', 0.0):.1e}"
        shape = f"  {c['shape']}" if "shape" in c else ""
        lines.append(f"{what} {'ok ' if c['ok'] else 'FAILED'}  {error}{shape}{tag}")
    if "real_shapes" in check:
        lines.append(f"  real shapes: {check['real_shapes']}{tag}")
    for t in check.get("timing", []):
        what = f"  time {t['path']} {t['n']}x{t['k']} {t['bits']}-bit g{t['group_size']} M={t['rows']}"
        if t.get("dtype", "float16") != "float16" or t.get("scale_dtype", "float16") != "float16":
            what += f" {t['dtype']} (scales {t['scale_dtype']})"
        if "skipped" in t or "error" in t:
            lines.append(f"{what}: {'skipped: ' + t['skipped'] if 'skipped' in t else 'FAILED: ' + t['error']}{tag}")
            continue
        lines.append(f"{what}: zero-point {t['zp_us']:.0f} us ({t['zp_gbps']:.0f} GB/s),"
                     f" mx.quantized_matmul {t['affine_us']:.0f} us: {t['speedup']:.2f}x;"
                     f" {'agrees' if t['ok'] else 'DISAGREES'} (max rel error"
                     f" {t['max_rel_error']:.1e}){tag}")
    if "timing_note" in check:
        lines.append(f"  timing: {check['timing_note']}{tag}")
    if "gpu_copy_gbps" in check:
        lines.append(f"  GPU copy bandwidth: {check['gpu_copy_gbps']:.0f} GB/s")
    if "qmm_choice_saved" in check:
        lines.append("  each kernel is used where it was faster; timings saved to "
                     f"{check['qmm_choice_saved']}")
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


class PrefillProgress:
    """A progress bar (stderr) for prompts long enough to take a while to prefill; a
    ``prompt_progress_callback``. Use as a context manager."""

    def __init__(self, min_tokens: int = 2048, enabled: bool = True):
        self.min_tokens, self.enabled, self.progress, self.task = min_tokens, enabled, None, None

    def __call__(self, done: int, total: int) -> None:
        if self.progress is None and self.enabled and total >= self.min_tokens and done < total:
            from rich.console import Console
            from rich.progress import Progress

            self.progress = Progress(console=Console(stderr=True), transient=True)
            self.progress.start()
            self.task = self.progress.add_task("prefill", total=total)
        if self.progress is not None:
            self.progress.update(self.task, completed=done)
            if done >= total:
                self.close()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def __enter__(self) -> PrefillProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
