"""The quality gate: a comparison's verdict against per-bit-width thresholds.

No quantized model ships without it: ``quantize_to_dir`` and ``mlxspec eval --save`` store the
verdict beside the weights, and ``mlxspec upload`` refuses a model without a passing one.
"""

from __future__ import annotations

from typing import Any

# bits -> (max mean KL in nats, min top-1 agreement in %). Widths without an entry are held to the
# bar of the next wider entry (2 and 3 bits to the 4-bit bar): override with explicit thresholds.
DEFAULT_THRESHOLDS: dict[int, dict[str, float]] = {
    8: {"max_kl": 0.01, "min_top1": 97.0},
    4: {"max_kl": 0.10, "min_top1": 88.0},
}


def default_thresholds(bits: int) -> dict[str, float]:
    """The default gate for ``bits``-bit weights (see ``DEFAULT_THRESHOLDS``)."""
    wider = [b for b in sorted(DEFAULT_THRESHOLDS) if b >= bits]
    return dict(DEFAULT_THRESHOLDS[wider[0] if wider else max(DEFAULT_THRESHOLDS)])


def gate(
    results: dict[str, Any], bits: int, thresholds: dict[str, float | None] | None = None
) -> dict[str, Any]:
    """Judge :func:`~mlxspec.evaluation.compare` results against the thresholds for ``bits``.

    Results by domain (:func:`~mlxspec.evaluation.compare_domains`) are judged domain by domain,
    so the worst domain decides: a model that is good on average and bad on one kind of text
    fails, naming that domain.

    Args:
        results: a comparison (needs ``kl_mean`` and ``top1_agreement``; or ``domains``, a
            comparison per domain).
        bits: the quantized weights' bit width.
        thresholds: ``{"max_kl": ..., "min_top1": ...}``; a missing or None entry keeps the default.

    Returns:
        ``{"passed": bool, "bits", "max_kl", "min_top1", "failures": [one line per failed check],
        "judged": "worst domain" | "all windows"}``.
    """
    limits = default_thresholds(bits)
    limits.update({k: v for k, v in (thresholds or {}).items() if v is not None})
    parts = results.get("domains") or {None: results}
    failures = []
    for domain, r in parts.items():
        where = f" on {domain}" if domain else ""
        if not r["kl_mean"] <= limits["max_kl"]:
            failures.append(f"mean KL{where} {r['kl_mean']:.4f} > {limits['max_kl']:g}")
        if not r["top1_agreement"] >= limits["min_top1"]:
            failures.append(
                f"top-1 agreement{where} {r['top1_agreement']:.2f}% < {limits['min_top1']:g}%")
    judged = "worst domain" if results.get("domains") else "all windows"
    return {"passed": not failures, "bits": bits, **limits, "failures": failures,
            "judged": judged}


def verdict_line(verdict: dict[str, Any]) -> str:
    """One line for the user: PASS or FAIL with the thresholds and what failed."""
    bar = f"{verdict['bits']}-bit gate: KL <= {verdict['max_kl']:g}, top-1 >= {verdict['min_top1']:g}%"
    if verdict.get("judged") == "worst domain":
        bar += " on every domain"
    if verdict["passed"]:
        return f"PASS ({bar})"
    return f"FAIL ({bar}): {'; '.join(verdict['failures'])}"
