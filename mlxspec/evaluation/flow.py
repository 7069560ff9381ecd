"""The evaluation flows: :func:`evaluate` (what ``mlxspec eval`` prints) and
:func:`evaluate_saved` (the quality gate of a quantized directory, stored beside it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import dequantize_model

from mlxspec.errors import EvaluationError, ModelNotFoundError
from mlxspec.evaluation.domains import DEFAULT_DOMAIN_WINDOWS, domain_windows
from mlxspec.evaluation.gate import gate
from mlxspec.evaluation.metrics import acceptance, compare, compare_domains, perplexity
from mlxspec.evaluation.records import save_results, source_model
from mlxspec.evaluation.windows import (
    DEFAULT_WINDOW_TOKENS,
    DEFAULT_WINDOWS,
    take_windows,
)
from mlxspec.gguf.tensors import dense_conversion
from mlxspec.load import load, read_config, resolve_model_path
from mlxspec.speculative.tokenizers import check_same_tokenizer

ModelSpec = str | Path | None  # a Hub repo id, a model directory, a .gguf file; None: the default


def evaluate(
    model: ModelSpec = None,
    reference: ModelSpec = None,
    draft: ModelSpec = None,
    *,
    text: str | Path | None = None,
    windows: int | None = None,
    window_tokens: int = DEFAULT_WINDOW_TOKENS,
    progress: bool = False,
) -> dict[str, Any]:
    """Measure ``model`` on fixed token windows, without generating: on the built-in held-out
    text by domain (:mod:`mlxspec.evaluation.domains`), or on the windows of one ``text`` file.

    - with ``draft``: the draft's expected acceptance rate per temperature and the tokens each
      target pass would yield (:func:`~mlxspec.evaluation.acceptance`);
    - else against ``reference`` (default: the source a quantized model's config records): KL,
      top-1 agreement and both perplexities (:func:`~mlxspec.evaluation.compare`);
    - else (nothing to compare with) the perplexity alone.

    Args:
        model, reference, draft: model specs (Hub repo id, directory, .gguf; None: the default).
        text: a UTF-8 text file to cut the windows from (default: the built-in held-out text,
            by domain).
        windows, window_tokens: how many windows, of how many tokens; windows default to
            ``DEFAULT_DOMAIN_WINDOWS`` per domain of the built-in text, ``DEFAULT_WINDOWS`` of a
            ``text`` file.
        progress: show a progress bar.

    Returns:
        A JSON-ready dict: ``model``, ``text``, ``windows``, ``window_tokens``, then ``draft`` and
        the acceptance keys, or ``reference`` and the comparison keys, or the perplexity keys.
        On the built-in text the comparison and the perplexity are pooled over the domains and
        given per domain too (``domains``; a comparison adds ``worst``, the domain of the
        highest mean KL); acceptance is pooled.

    Raises:
        EvaluationError: ``draft`` with ``reference``; a reference that is the model itself.
        TokenizerMismatchError: the other model does not share the model's tokenizer.
    """
    if draft is not None and reference is not None:
        raise EvaluationError("--draft excludes --reference: pass one of them")
    model_dir = resolve_model_path(model)
    reference_dir = None
    if draft is None:
        reference = reference or source_model(read_config(model_dir))
        reference_dir = _reference_dir(reference, model_dir) if reference is not None else None
    nn_model, tokenizer = load(model_dir)
    by_domain = _windows(tokenizer, text, windows, window_tokens)
    token_windows = [w for ws in by_domain.values() for w in ws]
    result: dict[str, Any] = {
        "model": str(model if model is not None else model_dir),
        "text": "builtin" if text is None else str(text),
        "windows": len(token_windows),
        "window_tokens": window_tokens,
    }
    nn_model = dense_on_cpu(nn_model)
    if draft is not None:
        draft_model, draft_tokenizer = load(draft)
        check_same_tokenizer(tokenizer, draft_tokenizer, "the draft model")
        measured = acceptance(nn_model, dense_on_cpu(draft_model), token_windows,
                              progress=progress)
        return {**result, "draft": str(draft), **measured}
    if reference_dir is None:
        measured = perplexity(nn_model, token_windows, progress=progress)
        if text is None:
            measured["domains"] = {d: perplexity(nn_model, w) for d, w in by_domain.items()}
        return {**result, **measured}
    reference_model, reference_tokenizer = load(reference_dir)
    check_same_tokenizer(tokenizer, reference_tokenizer, "the reference model")
    measured = _compare(nn_model, dense_on_cpu(reference_model), by_domain, text, progress)
    return {**result, "reference": str(reference), **measured}


def evaluate_saved(
    model_dir: str | Path,
    *,
    reference: ModelSpec = None,
    thresholds: dict[str, float | None] | None = None,
    text: str | Path | None = None,
    windows: int | None = None,
    window_tokens: int = DEFAULT_WINDOW_TOKENS,
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate the quantized model saved in ``model_dir`` against its source (``reference``, by
    default the one its config records), judge it, and store the record as
    ``model_dir/mlxspec_eval.json``. This is the quality gate of ``quantize_to_dir``.

    The model is loaded back from disk, so what is judged is exactly what would be uploaded.

    Returns:
        The stored record: ``{"results", "verdict", "reference", "text", "window_tokens"}``.
    """
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
    reference_dir = _reference_dir(reference, model_dir)
    model, tokenizer = load(model_dir)
    reference_model, reference_tokenizer = load(reference_dir)
    check_same_tokenizer(tokenizer, reference_tokenizer, "the reference model")
    by_domain = _windows(tokenizer, text, windows, window_tokens)
    results = _compare(dense_on_cpu(model), dense_on_cpu(reference_model), by_domain, text,
                       progress)
    record = {
        "results": results,
        "verdict": gate(results, int(quantization["bits"]), thresholds),
        "reference": str(reference),
        "text": "builtin" if text is None else str(text),
        "window_tokens": window_tokens,
    }
    save_results(model_dir, record)
    return record


def _windows(tokenizer, text, windows: int, window_tokens: int) -> dict[str, list[list[int]]]:
    """The windows by domain: the built-in domains, or ``{"text": windows of the file}``."""
    if text is None:
        return domain_windows(tokenizer, windows or DEFAULT_DOMAIN_WINDOWS, window_tokens)
    return {"text": take_windows(tokenizer, text, windows or DEFAULT_WINDOWS, window_tokens)}


def _compare(model, reference_model, by_domain, text, progress: bool) -> dict[str, Any]:
    if text is None:
        return compare_domains(model, reference_model, by_domain, progress=progress)
    return compare(model, reference_model, by_domain["text"], progress=progress)


def dense_on_cpu(model: nn.Module) -> nn.Module:
    """Without a Metal device, swap mlx-lm's quantized layers for float copies of their
    dequantized weights (mlx-lm's ``dequantize_model``); returns ``model`` (changed in place).

    The copies hold exactly the weights the quantized layers multiply by, so the results are the
    quantized model's up to summation order (~1e-6 relative), while MLX's CPU
    ``quantized_matmul`` is a plain loop tens of times slower than BLAS on the windows' hundreds
    of rows. mlxspec's own zero-point layers already do this on the CPU.
    """
    if mx.metal.is_available():
        return model
    dequantize_model(model)
    mx.eval(model.parameters())
    return model


def _reference_dir(reference: ModelSpec, model_dir: Path) -> Path:
    """The local directory of a reference model; never the model itself (a gate comparing a
    model with itself would pass anything)."""
    try:
        with dense_conversion():  # the float reference, even where GGUFs import quantized
            reference_dir = resolve_model_path(None if reference == "default" else reference)
    except ModelNotFoundError as e:
        raise EvaluationError(
            f"the reference model {reference} is not available here ({e}): pass --reference"
        ) from e
    if _same_directory(reference_dir, model_dir):
        raise EvaluationError(
            f"the reference {reference} is {model_dir} itself: compare with the unquantized "
            "source model (--reference)"
        )
    return reference_dir


def _same_directory(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()
