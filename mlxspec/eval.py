"""Quality evaluation: perplexity, divergence from a reference model, and draft acceptance.

Everything here runs teacher-forced forward passes over fixed token windows; nothing is generated.
For each window of T tokens a model predicts positions 1..T-1 from the tokens before them, so a
window contributes T-1 scored positions.

- :func:`perplexity`: ``exp(mean NLL)`` with its standard error (delta method, as mlx-lm's
  ``perplexity.py``: ``se(ppl) = ppl * std(NLL) / sqrt(N)``).
- :func:`compare`: a model against the reference it was quantized from, on the very same windows:
  mean and 99th-percentile KL(reference || model) in nats per token, same-top-1 agreement (%), both
  perplexities and their difference.
- :func:`acceptance`: for a target and a draft, the expected speculative acceptance rate
  ``alpha = E[sum_x min(p(x), q(x))]`` at several temperatures, and :func:`tokens_per_pass`, the
  tokens one target pass yields with k drafted tokens, ``(1 - alpha**(k+1)) / (1 - alpha)``
  (Leviathan et al., 2023, with i.i.d. acceptances).
- :func:`gate`: the verdict of a comparison against per-bit-width thresholds.

Token windows come from the built-in held-out text (:func:`builtin_windows`, ``data/eval.txt``,
disjoint from the quantizers' calibration text) or any text file (:func:`text_windows`, streamed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from importlib.resources import files
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from mlxspec.errors import EvaluationError, TokenizerMismatchError

EVAL_FILE = "mlxspec_eval.json"  # evaluation results stored beside a quantized model
SOURCE_KEY = "source_model"  # config.json["quantization"][SOURCE_KEY]: what it was quantized from
DEFAULT_WINDOWS = 8
DEFAULT_WINDOW_TOKENS = 256
TEMPERATURES = (0.0, 0.7, 1.0)
MAX_DRAFT_TOKENS = 8
CHUNK_CHARS = 1 << 14  # text is tokenized this many characters at a time
BUILTIN_TEXT_TITLE = "Jane Austen, *Persuasion*, chapters 1-6"  # data/eval.txt, see PROVENANCE.md

# bits -> (max mean KL in nats, min top-1 agreement in %). Widths without an entry are held to the
# bar of the next wider entry (2 and 3 bits to the 4-bit bar): override with explicit thresholds.
DEFAULT_THRESHOLDS: dict[int, dict[str, float]] = {
    8: {"max_kl": 0.01, "min_top1": 97.0},
    4: {"max_kl": 0.10, "min_top1": 88.0},
}


# -- token windows ------------------------------------------------------------------------------


def builtin_text() -> str:
    """The held-out evaluation prose shipped with the package (``mlxspec/data/eval.txt``)."""
    return (files("mlxspec") / "data" / "eval.txt").read_text(encoding="utf-8")


def _encode(tokenizer, text: str) -> list[int]:
    # Plain text tokens, no BOS/EOS: windows are cut from the middle of a long text.
    return list(tokenizer.encode(text, add_special_tokens=False))


def _check_window_args(windows: int | None, window_tokens: int) -> None:
    if window_tokens < 2:
        raise EvaluationError(f"window length {window_tokens} is too short: use at least 2 tokens")
    if windows is not None and windows < 1:
        raise EvaluationError(f"{windows} windows asked for: use at least 1")


def builtin_windows(
    tokenizer, windows: int | None = DEFAULT_WINDOWS, window_tokens: int = DEFAULT_WINDOW_TOKENS
) -> list[list[int]]:
    """Consecutive, non-overlapping windows of the built-in evaluation text.

    Args:
        tokenizer: anything with ``encode(text, add_special_tokens=False)`` (a TokenizerWrapper).
        windows: number of windows; None takes every whole window the text holds.
        window_tokens: tokens per window.

    Returns:
        ``windows`` lists of ``window_tokens`` token ids, in text order.
    """
    _check_window_args(windows, window_tokens)
    text = builtin_text()
    chunks = (text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS))
    out = list(_windows(tokenizer, _whole_lines(chunks), window_tokens))
    if windows is not None and windows > len(out):
        raise EvaluationError(
            f"the built-in text holds {len(out)} windows of {window_tokens} tokens, not "
            f"{windows}: ask for fewer or shorter windows, or pass --text FILE"
        )
    return out if windows is None else out[:windows]


def text_windows(
    tokenizer, path: str | Path, window_tokens: int = DEFAULT_WINDOW_TOKENS
) -> Iterator[list[int]]:
    """Stream consecutive windows of ``window_tokens`` tokens from a UTF-8 text file.

    The file is read and tokenized ``CHUNK_CHARS`` characters at a time (cut at line ends), so
    memory stays bounded on long files; a last partial window is dropped.
    """
    _check_window_args(None, window_tokens)
    path = Path(path)
    if not path.is_file():
        raise EvaluationError(f"text file not found: {path}")
    try:
        with path.open(encoding="utf-8") as f:
            chunks = iter(lambda: f.read(CHUNK_CHARS), "")
            yield from _windows(tokenizer, _whole_lines(chunks), window_tokens)
    except UnicodeDecodeError as e:
        raise EvaluationError(f"{path} is not UTF-8 text: {e.reason}") from e


def _whole_lines(chunks: Iterable[str]) -> Iterator[str]:
    """Re-cut text chunks at line ends, so that no word is split between two tokenizer calls."""
    carry = ""
    for chunk in chunks:
        head, sep, tail = (carry + chunk).rpartition("\n")
        if sep:
            yield head + sep
            carry = tail
        else:
            carry = tail
    if carry:
        yield carry


def _windows(tokenizer, chunks: Iterable[str], window_tokens: int) -> Iterator[list[int]]:
    pending: list[int] = []
    for chunk in chunks:
        pending.extend(_encode(tokenizer, chunk))
        while len(pending) >= window_tokens:
            yield pending[:window_tokens]
            pending = pending[window_tokens:]


def take_windows(
    tokenizer, text: str | Path | None, windows: int | None, window_tokens: int
) -> list[list[int]]:
    """``windows`` windows from ``text`` (a file), or from the built-in text when it is None."""
    if text is None:
        return builtin_windows(tokenizer, windows, window_tokens)
    _check_window_args(windows, window_tokens)
    out = []
    for window in text_windows(tokenizer, text, window_tokens):
        out.append(window)
        if windows is not None and len(out) == windows:
            break
    if not out or (windows is not None and len(out) < windows):
        raise EvaluationError(
            f"{text} holds {len(out)} windows of {window_tokens} tokens, fewer than {windows}: "
            "ask for fewer or shorter windows, or give a longer text"
        )
    return out


def check_same_tokenizer(tokenizer, other_tokenizer, what: str = "the reference model") -> None:
    """Raise TokenizerMismatchError unless both tokenizers split the built-in text identically."""
    sample = builtin_text()[:4000]
    if _encode(tokenizer, sample) != _encode(other_tokenizer, sample):
        raise TokenizerMismatchError(
            f"{what} tokenizes text differently from the model: compare models that share a "
            "tokenizer"
        )


def dense_on_cpu(model: nn.Module) -> nn.Module:
    """Replace mlx-lm's ``QuantizedLinear``/``QuantizedEmbedding`` layers by float copies of their
    dequantized weights when there is no Metal device; returns ``model`` (changed in place).

    The copies hold exactly the weights the quantized layers multiply by (``scale * q + bias``),
    so the results are the quantized model's up to summation order (~1e-6 relative), while MLX's
    CPU ``quantized_matmul`` is a plain loop tens of times slower than BLAS on the windows'
    hundreds of rows. mlxspec's own zero-point layers already do this on the CPU.
    """
    if mx.metal.is_available():
        return model
    dense = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        weight = mx.dequantize(
            module.weight, module.scales, module.get("biases"), group_size=module.group_size,
            bits=module.bits, mode=module.mode,
        )
        if isinstance(module, nn.QuantizedEmbedding):
            layer = nn.Embedding(*weight.shape)
        else:
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                layer.bias = module.bias
        layer.weight = weight
        dense.append((name, layer))
    if dense:
        model.update_modules(tree_unflatten(dense))
        mx.eval(model.parameters())
    return model


# -- forward passes -----------------------------------------------------------------------------


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
    return tuple(_log_softmax(x[:, :vocab]) for x in logits)


def _logits(model: nn.Module, window: Sequence[int]) -> mx.array:
    """float32 ``(T-1, V)`` next-token logits for the first T-1 tokens of ``window``."""
    inputs = mx.array(np.asarray(window[:-1], dtype=np.int32))[None]
    return model(inputs)[0].astype(mx.float32)


def _log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _targets(window: Sequence[int]) -> mx.array:
    return mx.array(np.asarray(window[1:], dtype=np.int32))


def _nll(log_probs: mx.array, targets: mx.array) -> mx.array:
    """float32 ``(T-1,)`` negative log-likelihood of ``targets`` (int ``(T-1,)``)."""
    return -mx.take_along_axis(log_probs, targets[:, None], axis=-1)[:, 0]


@contextmanager
def _progress(description: str, total: int | None, show: bool):
    """A rich progress bar over windows (a no-op when ``show`` is False)."""
    if not show:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress(
        "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
        TimeRemainingColumn(), transient=True, console=Console(stderr=True),
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)


def _total(windows: Iterable) -> int | None:
    return len(windows) if hasattr(windows, "__len__") else None


def _check_window(window: Sequence[int]) -> None:
    if len(window) < 2:
        raise EvaluationError("a token window needs at least 2 tokens")


def _ppl(nll: np.ndarray) -> tuple[float, float]:
    """(perplexity, its standard error) from per-token NLLs in nats."""
    mean = float(nll.mean())
    std_error = float(nll.std(ddof=1)) / math.sqrt(nll.size) if nll.size > 1 else 0.0
    ppl = math.exp(mean)
    return ppl, ppl * std_error


# -- the three measurements ---------------------------------------------------------------------


def perplexity(
    model: nn.Module, token_windows: Iterable[Sequence[int]], *, progress: bool = False
) -> dict[str, float]:
    """Perplexity of ``model`` on the windows.

    Returns:
        ``{"perplexity", "perplexity_se", "nll", "tokens", "windows"}`` (NLL in nats per token).
    """
    nlls, n_windows = [], 0
    with _progress("perplexity", _total(token_windows), progress) as advance:
        for window in token_windows:
            _check_window(window)
            nll = _nll(_log_softmax(_logits(model, window)), _targets(window))
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
        progress: show a rich progress bar.

    Returns:
        A JSON-ready dict:
        ``kl_mean``, ``kl_p99``: KL(reference || model) per scored position, in nats;
        ``top1_agreement``: % of positions where both models' most likely next token is the same;
        ``perplexity``, ``perplexity_se``, ``reference_perplexity``, ``reference_perplexity_se``;
        ``perplexity_delta``: model minus reference perplexity; ``perplexity_delta_pct``: relative
        to the reference, in %; ``tokens``: scored positions; ``windows``: windows read.
    """
    kls, nlls, ref_nlls, agree = [], [], [], 0
    with _progress("comparing with the reference", _total(token_windows), progress) as advance:
        for window in token_windows:
            _check_window(window)
            logq, logp = _pair_log_probs(model, reference_model, window)
            targets = _targets(window)
            kl = (mx.exp(logp) * (logp - logq)).sum(axis=-1)
            same = (logp.argmax(axis=-1) == logq.argmax(axis=-1)).sum()
            nll, ref_nll = _nll(logq, targets), _nll(logp, targets)
            mx.eval(kl, same, nll, ref_nll)
            kls.append(np.array(kl))
            nlls.append(np.array(nll))
            ref_nlls.append(np.array(ref_nll))
            agree += int(same.item())
            advance()
    if not kls:
        raise EvaluationError("no token windows to evaluate")
    # Rounding can make a KL of identical distributions come out a hair below zero.
    kl = np.maximum(np.concatenate(kls).astype(np.float64), 0.0)
    ppl, ppl_se = _ppl(np.concatenate(nlls).astype(np.float64))
    ref_ppl, ref_se = _ppl(np.concatenate(ref_nlls).astype(np.float64))
    return {
        "kl_mean": float(kl.mean()),
        "kl_p99": float(np.percentile(kl, 99)),
        "top1_agreement": 100.0 * agree / kl.size,
        "perplexity": ppl,
        "perplexity_se": ppl_se,
        "reference_perplexity": ref_ppl,
        "reference_perplexity_se": ref_se,
        "perplexity_delta": ppl - ref_ppl,
        "perplexity_delta_pct": 100.0 * (ppl - ref_ppl) / ref_ppl,
        "tokens": int(kl.size),
        "windows": len(kls),
    }


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
    with _progress("draft acceptance", _total(token_windows), progress) as advance:
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


# -- the quality gate ---------------------------------------------------------------------------


def default_thresholds(bits: int) -> dict[str, float]:
    """The default gate for ``bits``-bit weights (see ``DEFAULT_THRESHOLDS``)."""
    wider = [b for b in sorted(DEFAULT_THRESHOLDS) if b >= bits]
    return dict(DEFAULT_THRESHOLDS[wider[0] if wider else max(DEFAULT_THRESHOLDS)])


def gate(
    results: dict[str, Any], bits: int, thresholds: dict[str, float | None] | None = None
) -> dict[str, Any]:
    """Judge :func:`compare` results against the thresholds for ``bits``-bit weights.

    Args:
        results: a :func:`compare` result (needs ``kl_mean`` and ``top1_agreement``).
        bits: the quantized weights' bit width.
        thresholds: ``{"max_kl": ..., "min_top1": ...}``; a missing or None entry keeps the default.

    Returns:
        ``{"passed": bool, "bits", "max_kl", "min_top1", "failures": [one line per failed check]}``.
    """
    limits = default_thresholds(bits)
    limits.update({k: v for k, v in (thresholds or {}).items() if v is not None})
    failures = []
    if not results["kl_mean"] <= limits["max_kl"]:
        failures.append(f"mean KL {results['kl_mean']:.4f} > {limits['max_kl']:g}")
    if not results["top1_agreement"] >= limits["min_top1"]:
        failures.append(f"top-1 agreement {results['top1_agreement']:.2f}% < {limits['min_top1']:g}%")
    return {"passed": not failures, "bits": bits, **limits, "failures": failures}


def verdict_line(verdict: dict[str, Any]) -> str:
    """One line for the user: PASS or FAIL with the thresholds and what failed."""
    bar = f"{verdict['bits']}-bit gate: KL <= {verdict['max_kl']:g}, top-1 >= {verdict['min_top1']:g}%"
    if verdict["passed"]:
        return f"PASS ({bar})"
    return f"FAIL ({bar}): {'; '.join(verdict['failures'])}"


# -- stored results -----------------------------------------------------------------------------


def save_results(model_dir: str | Path, record: dict[str, Any]) -> Path:
    """Write ``record`` (results, verdict, settings) to ``model_dir/mlxspec_eval.json``."""
    path = Path(model_dir) / EVAL_FILE
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_results(model_dir: str | Path) -> dict[str, Any] | None:
    """The stored evaluation record of a model directory, or None when it has none."""
    path = Path(model_dir) / EVAL_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EvaluationError(f"{path} is not valid JSON ({e}): re-run `mlxspec eval`") from e


def source_model(config: dict[str, Any]) -> str | None:
    """What a quantized model was quantized from (``config["quantization"]["source_model"]``)."""
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    return quantization.get(SOURCE_KEY) if isinstance(quantization, dict) else None


def evaluate_against(
    model: nn.Module,
    tokenizer,
    reference_model: nn.Module,
    *,
    bits: int,
    reference: str,
    thresholds: dict[str, float | None] | None = None,
    text: str | Path | None = None,
    windows: int = DEFAULT_WINDOWS,
    window_tokens: int = DEFAULT_WINDOW_TOKENS,
    progress: bool = True,
) -> dict[str, Any]:
    """Compare a quantized model with its source and judge it: the record stored as
    ``mlxspec_eval.json`` (``{"results", "verdict", "reference", "text", "window_tokens"}``).

    ``reference`` names the source model for the record (a Hub id, directory or GGUF file).
    """
    token_windows = take_windows(tokenizer, text, windows, window_tokens)
    results = compare(model, reference_model, token_windows, progress=progress)
    return {
        "results": results,
        "verdict": gate(results, bits, thresholds),
        "reference": reference,
        "text": "builtin" if text is None else str(text),
        "window_tokens": window_tokens,
    }


def evaluate_saved(
    model_dir: str | Path,
    *,
    reference: str | None = None,
    thresholds: dict[str, float | None] | None = None,
    text: str | Path | None = None,
    windows: int = DEFAULT_WINDOWS,
    window_tokens: int = DEFAULT_WINDOW_TOKENS,
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate the quantized model saved in ``model_dir`` against its source (``reference``, by
    default the one its config records), judge it, and store the record as
    ``model_dir/mlxspec_eval.json``. This is the quality gate of ``mlxspec quantize``.

    The model is loaded back from disk, so what is judged is exactly what would be uploaded.
    """
    from mlxspec.load import load, read_config

    model_dir = Path(model_dir)
    config = read_config(model_dir)
    quantization = config.get("quantization")
    if not isinstance(quantization, dict) or "bits" not in quantization:
        raise EvaluationError(f"{model_dir} is not a quantized model: nothing to gate")
    reference = reference or source_model(config)
    if reference is None:
        raise EvaluationError(
            f"{model_dir} records no source model: pass the unquantized model with --reference"
        )
    model, tokenizer = load(model_dir)
    reference_model, reference_tokenizer = load_reference(reference)
    check_same_tokenizer(tokenizer, reference_tokenizer)
    record = evaluate_against(
        dense_on_cpu(model), tokenizer, dense_on_cpu(reference_model),
        bits=int(quantization["bits"]), reference=reference, thresholds=thresholds, text=text,
        windows=windows, window_tokens=window_tokens, progress=progress,
    )
    save_results(model_dir, record)
    return record


def load_reference(reference: str):
    """``mlxspec.load(reference)``, with a hint when a recorded source is not on this machine."""
    from mlxspec.errors import ModelNotFoundError
    from mlxspec.load import load

    try:
        return load(None if reference == "default" else reference)
    except ModelNotFoundError as e:
        raise EvaluationError(
            f"the reference model {reference} is not available here ({e}): pass --reference"
        ) from e
