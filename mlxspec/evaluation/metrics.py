"""The three measurements, teacher-forced over token windows (nothing is generated).

- :func:`perplexity`: ``exp(mean NLL)`` with its standard error (delta method, as mlx-lm's
  ``perplexity.py``: ``se(ppl) = ppl * std(NLL) / sqrt(N)``).
- :func:`compare`: a model against a reference on the very same windows: mean and 99th-percentile
  KL(reference || model) in nats per token, same-top-1 agreement (%), both perplexities.
- :func:`acceptance`: for a target and a draft, the expected speculative acceptance rate
  ``alpha = E[sum_x min(p(x), q(x))]`` at several temperatures, and :func:`tokens_per_pass`, the
  tokens one target pass yields with k drafted tokens, ``(1 - alpha**(k+1)) / (1 - alpha)``
  (Leviathan et al., 2023, with i.i.d. acceptances).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxspec.errors import EvaluationError
from mlxspec.progress import progress_bar
from mlxspec.sampling import normalized_logprobs

TEMPERATURES = (0.0, 0.7, 1.0)
MAX_DRAFT_TOKENS = 8


def perplexity(
    model: nn.Module, token_windows: Iterable[Sequence[int]], *, progress: bool = False
) -> dict[str, float]:
    """Perplexity of ``model`` on the windows.

    Returns:
        ``{"perplexity", "perplexity_se", "nll", "tokens", "windows"}`` (NLL in nats per token).
    """
    nlls, n_windows = [], 0
    with progress_bar("perplexity", _total(token_windows), progress) as advance:
        for window in token_windows:
            _check_window(window)
            nll = _nll(normalized_logprobs(_logits(model, window)), _targets(window))
            nlls.append(np.array(nll))
            n_windows += 1
            advance()
    if not nlls:
        raise EvaluationError("no token windows to evaluate")
    nll = np.concatenate(nlls).astype(np.float64)
    ppl, se = _ppl(nll)
    return {"perplexity": ppl, "perplexity_se": se, "nll": float(nll.mean()),
            "tokens": int(nll.size), "windows": n_windows}


def compare(
    model: nn.Module,
    reference_model: nn.Module,
    token_windows: Iterable[Sequence[int]],
    *,
    progress: bool = False,
) -> dict[str, float | int]:
    """Compare ``model`` with ``reference_model`` on the very same token windows.

    Args:
        model: the model under test (e.g. a quantized copy).
        reference_model: the model it should match (e.g. the unquantized source); same tokenizer.
        token_windows: lists of token ids (each at least 2 long); may be a generator.
        progress: show a progress bar.

    Returns:
        A JSON-ready dict:
        ``kl_mean``, ``kl_p99``: KL(reference || model) per scored position, in nats;
        ``top1_agreement``: % of positions where both models' most likely next token is the same;
        ``perplexity``, ``perplexity_se``, ``reference_perplexity``, ``reference_perplexity_se``;
        ``perplexity_delta``: model minus reference perplexity; ``perplexity_delta_pct``: relative
        to the reference, in %; ``tokens``: scored positions; ``windows``: windows read.
    """
    return _summary(_comparison_arrays(model, reference_model, token_windows,
                                       "comparing with the reference", progress))


def compare_domains(
    model: nn.Module,
    reference_model: nn.Module,
    windows_by_domain: dict[str, Sequence[Sequence[int]]],
    *,
    progress: bool = False,
) -> dict[str, Any]:
    """:func:`compare` on each domain's windows, pooled, and the worst domain.

    Returns:
        The pooled comparison (every domain's positions together, the keys of :func:`compare`),
        with ``domains``: ``{domain: comparison}``, and ``worst``: the comparison of the domain
        with the highest mean KL, plus its name as ``domain``.
    """
    if not windows_by_domain:
        raise EvaluationError("no token windows to evaluate")
    arrays = {d: _comparison_arrays(model, reference_model, w, f"comparing ({d})", progress)
              for d, w in windows_by_domain.items()}
    per = {d: _summary(a) for d, a in arrays.items()}
    pooled = _summary(tuple(np.concatenate([a[i] for a in arrays.values()]) for i in range(4))
                      + (sum(a[4] for a in arrays.values()),))
    worst = max(per, key=lambda d: per[d]["kl_mean"])
    return {**pooled, "domains": per, "worst": {"domain": worst, **per[worst]}}


def _comparison_arrays(model, reference_model, token_windows, label: str, progress: bool):
    """Per scored position: (KL, same top-1, NLL, reference NLL) as numpy arrays, and the number
    of windows."""
    kls, same, nlls, ref_nlls = [], [], [], []
    with progress_bar(label, _total(token_windows), progress) as advance:
        for window in token_windows:
            _check_window(window)
            logq, logp = _pair_log_probs(model, reference_model, window)
            targets = _targets(window)
            kl = (mx.exp(logp) * (logp - logq)).sum(axis=-1)
            agree = logp.argmax(axis=-1) == logq.argmax(axis=-1)
            nll, ref_nll = _nll(logq, targets), _nll(logp, targets)
            mx.eval(kl, agree, nll, ref_nll)
            kls.append(np.array(kl))
            same.append(np.array(agree))
            nlls.append(np.array(nll))
            ref_nlls.append(np.array(ref_nll))
            advance()
    if not kls:
        raise EvaluationError("no token windows to evaluate")
    return (np.concatenate(kls), np.concatenate(same), np.concatenate(nlls),
            np.concatenate(ref_nlls), len(kls))


def _summary(arrays) -> dict[str, float | int]:
    kls, same, nlls, ref_nlls, n_windows = arrays
    # Rounding can make a KL of identical distributions come out a hair below zero.
    kl = np.maximum(kls.astype(np.float64), 0.0)
    ppl, ppl_se = _ppl(nlls.astype(np.float64))
    ref_ppl, ref_se = _ppl(ref_nlls.astype(np.float64))
    return {
        "kl_mean": float(kl.mean()),
        "kl_p99": float(np.percentile(kl, 99)),
        "top1_agreement": 100.0 * float(same.mean()),
        "perplexity": ppl,
        "perplexity_se": ppl_se,
        "reference_perplexity": ref_ppl,
        "reference_perplexity_se": ref_se,
        "perplexity_delta": ppl - ref_ppl,
        "perplexity_delta_pct": 100.0 * (ppl - ref_ppl) / ref_ppl,
        "tokens": int(kl.size),
        "windows": n_windows,
    }


def tokens_per_pass(alpha: float, k: int) -> float:
    """Expected tokens one target pass yields with ``k`` drafted tokens and acceptance ``alpha``:
    ``1 + alpha + ... + alpha**k = (1 - alpha**(k+1)) / (1 - alpha)``."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def acceptance(
    target: nn.Module,
    draft: nn.Module,
    token_windows: Iterable[Sequence[int]],
    *,
    temperatures: Sequence[float] = TEMPERATURES,
    max_draft_tokens: int = MAX_DRAFT_TOKENS,
    progress: bool = False,
) -> dict[str, Any]:
    """Predict what speculative decoding with ``draft`` gains for ``target``, without generating.

    Returns:
        ``{"temperatures": {"0.7": {"alpha": a, "tokens_per_pass": {"1": ..., ..., "8": ...}}},
        "tokens": N, "windows": W}``: the mean acceptance rate per temperature and the implied
        tokens per target pass for k = 1..max_draft_tokens.
    """
    sums = {t: 0.0 for t in temperatures}
    count, n_windows = 0, 0
    with progress_bar("draft acceptance", _total(token_windows), progress) as advance:
        for window in token_windows:
            _check_window(window)
            logp, logq = _pair_log_probs(target, draft, window)
            per_temp = [_acceptance_at(logp, logq, t).sum() for t in temperatures]
            mx.eval(per_temp)
            for t, s in zip(temperatures, per_temp, strict=True):
                sums[t] += float(s.item())
            count += len(window) - 1
            n_windows += 1
            advance()
    if not count:
        raise EvaluationError("no token windows to evaluate")
    out = {}
    for t in temperatures:
        alpha = sums[t] / count
        out[f"{t:g}"] = {
            "alpha": alpha,
            "tokens_per_pass": {
                str(k): tokens_per_pass(alpha, k) for k in range(1, max_draft_tokens + 1)
            },
        }
    return {"temperatures": out, "tokens": count, "windows": n_windows}


# -- forward passes -----------------------------------------------------------------------------


def _logits(model: nn.Module, window: Sequence[int]) -> mx.array:
    """float32 ``(T-1, V)`` next-token logits for the first T-1 tokens of ``window``."""
    inputs = mx.array(np.asarray(window[:-1], dtype=np.int32))[None]
    return model(inputs)[0].astype(mx.float32)


def _pair_log_probs(
    model: nn.Module, other: nn.Module, window: Sequence[int]
) -> tuple[mx.array, mx.array]:
    """float32 ``(T-1, V)`` log-probabilities of positions 1..T-1 given the tokens before them,
    for ``model`` and ``other`` over their common vocabulary.

    Models of one tokenizer may pad their embedding tables to different sizes; ids beyond the
    shorter table never occur in text, so both are cut to the first ``V`` logits.
    """
    logits = [_logits(m, window) for m in (model, other)]
    vocab = min(x.shape[-1] for x in logits)
    return tuple(normalized_logprobs(x[:, :vocab]) for x in logits)


def _acceptance_at(logp: mx.array, logq: mx.array, temp: float) -> mx.array:
    """Per-position acceptance ``sum_x min(p_T(x), q_T(x))`` (float32 ``(T-1,)``).

    At temperature 0 both models are greedy (one-hot), so a draft token is accepted exactly when
    the argmaxes agree.
    """
    if temp == 0:
        return (logp.argmax(axis=-1) == logq.argmax(axis=-1)).astype(mx.float32)
    p = mx.softmax(logp / temp, axis=-1)
    q = mx.softmax(logq / temp, axis=-1)
    return mx.minimum(p, q).sum(axis=-1)


def _targets(window: Sequence[int]) -> mx.array:
    return mx.array(np.asarray(window[1:], dtype=np.int32))


def _nll(log_probs: mx.array, targets: mx.array) -> mx.array:
    """float32 ``(T-1,)`` negative log-likelihood of ``targets`` (int ``(T-1,)``)."""
    return -mx.take_along_axis(log_probs, targets[:, None], axis=-1)[:, 0]


def _ppl(nll: np.ndarray) -> tuple[float, float]:
    """(perplexity, its standard error) from per-token NLLs in nats."""
    mean = float(nll.mean())
    std_error = float(nll.std(ddof=1)) / math.sqrt(nll.size) if nll.size > 1 else 0.0
    ppl = math.exp(mean)
    return ppl, ppl * std_error


def _total(windows: Iterable) -> int | None:
    return len(windows) if hasattr(windows, "__len__") else None


def _check_window(window: Sequence[int]) -> None:
    if len(window) < 2:
        raise EvaluationError("a token window needs at least 2 tokens")
