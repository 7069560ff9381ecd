"""The quantization driver: a whole model into zero-point layers, in memory, with scales exact in
the model's dtype (so :func:`mlxspec.quant.storage.save_quantized` writes MLX's affine layout).

    model, quantization = quantize_model(model, bits=4, group_size=64, method="gptq",
                                         calibration_tokens=calibration_windows(tokenizer)[0])
    save_quantized(model, "out", config=config, quantization=quantization, source_dir=src)

(``save_quantized`` lives in :mod:`mlxspec.quant.storage`.)

Which layers get which bits is a *plan*: every ``nn.Linear`` and ``nn.Embedding`` (a tied output
head is the embedding) at ``bits``/``group_size``, unless a recipe rule says otherwise
(:func:`load_recipe`; JSON files in ``models/quantization/``, installed as ``mlxspec.recipes``).

Methods:

- ``rtn``: round-to-nearest, min-max by default (:mod:`mlxspec.quant.rtn`).
- ``gptq``: the decoder blocks' linears with GPTQ (:class:`mlxspec.quant.gptq.GPTQ`), block by
  block (:mod:`mlxspec.quant.calibrate`): each block's linears get their Hessians from that
  block's inputs, are quantized, and the *quantized* block's outputs become the next block's
  inputs. Embeddings and an untied ``lm_head`` use ``rtn``.
- ``awq``: the same block-by-block walk; each group of linears sharing an input gets
  activation-aware scales folded into the norm or linear producing that input, then
  importance-weighted ``rtn`` (:class:`mlxspec.quant.awq.AWQ`).
- ``awq+gptq``: AWQ's scales, then GPTQ on the scaled weights with the scaled inputs' Hessian.

Each calibrated method is one :class:`~mlxspec.quant.calibrate.BlockQuantizer`; this module only
plans, walks the blocks and records what was done.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxspec.errors import QuantizationError
from mlxspec.progress import progress_bar
from mlxspec.quant import awq, gptq, rtn, zp_format
from mlxspec.quant.calibrate import (
    CALIBRATION_BATCH,
    BlockQuantizer,
    block_inputs,
    record_block,
)
from mlxspec.quant.layers import replace_modules, zero_point_like
from mlxspec.quant.mixed import LayerSpec, load_recipe, plan_layers, quantizable_layers
from mlxspec.quant.storage import (
    ZP_FORMAT,
    cast_floats,
    model_dtype,
)

METHODS = ("rtn", "gptq", "awq", "awq+gptq")
CALIBRATED = ("gptq", "awq", "awq+gptq")  # the methods that run calibration text through the model
# Clipping ratios tried for an embedding table, whatever the method (none calibrates it): its rows
# are used as they are stored, so the weights' own error is the right objective. Measured with
# only the (tied) embedding quantized, 4-bit g64, KL on held-out text: SmolLM2 min-max 0.142,
# clipped 0.124; Gemma-3 (262k rows, 62 % of its weights) 0.261 and 0.213.
EMBEDDING_GRID = 10
# awq+gptq's GPTQ settings, measured on Gemma-3-270M 4-bit g64 (KL prose / code / technical on
# held-out text, bench/results/quantized_head_gemma3.jsonl): natural column order and a head
# damped 0.01 0.554 / 0.564 / 0.496; act-order (static groups) in the blocks and the head
# damped 0.1 0.485 / 0.549 / 0.469. Either change alone moved error from prose to code. On
# SmolLM2 (bench/results/quantized_domains_smollm2.jsonl, prose / code / chat / technical) it
# went from 0.221 / 0.191 / 0.183 / 0.138 to 0.196 / 0.169 / 0.185 / 0.126.
AWQ_GPTQ_ACT_ORDER = True
HEAD_DAMP = {"gptq": gptq.DEFAULT_DAMP, "awq+gptq": 0.1}


# -- calibration text ----------------------------------------------------------------------------


# -- quantizing ----------------------------------------------------------------------------------


def _rtn_layer(module: nn.Module, spec: LayerSpec, grid: int, dtype: mx.Dtype) -> nn.Module:
    q, scales, zeros = rtn.quantize(
        np.array(module.weight.astype(mx.float32)), spec.bits, spec.group_size, grid=grid,
        dtype=zp_format.dtype_name(dtype),
    )
    return zero_point_like(module, q, scales, zeros, bits=spec.bits, group_size=spec.group_size,
                           dtype=dtype)


def _calibrated_blocks(model, plan, calibration: mx.array, method: BlockQuantizer, advance):
    """Quantize every planned linear inside the decoder blocks, block by block, with
    ``method`` (:class:`~mlxspec.quant.gptq.GPTQ` or :class:`~mlxspec.quant.awq.AWQ`) given
    each linear's Hessian (:mod:`mlxspec.quant.calibrate`)."""
    if not isinstance(getattr(model, "layers", None), list):
        raise QuantizationError("calibrated methods need an mlx-lm model with decoder blocks "
                                "(model.layers): use --method rtn")
    paths = {id(m): p for p, m in model.named_modules()}
    chunks = [calibration[i : i + CALIBRATION_BATCH]
              for i in range(0, calibration.shape[0], CALIBRATION_BATCH)]
    hidden, calls = [], None
    for chunk in chunks:
        x, chunk_calls = block_inputs(model, chunk)
        mx.eval(x)
        hidden.append(x)
        calls = calls or chunk_calls
    done = set()
    for block, (args, kwargs) in zip(model.layers, calls, strict=True):
        prefix = paths[id(block)]
        targets = {
            name: module for name, module in block.named_modules()
            if plan.get(f"{prefix}.{name}") is not None and isinstance(module, nn.Linear)
        }
        recorders = record_block(block, targets, hidden, args, kwargs,
                                 track_norms=method.needs_norms)
        quantized = method.quantize_block(block, prefix, targets, recorders, plan,
                                          check=(hidden[0], args, kwargs))
        replace_modules(block, quantized)
        for name in quantized:
            done.add(f"{prefix}.{name}")
            advance()
        hidden = [block(x, *args, **kwargs) for x in hidden]
        mx.eval(hidden)
    return done, hidden


def output_head(model: nn.Module) -> tuple[str, nn.Module, nn.Module] | None:
    """``(path, layer, final norm)`` of the layer producing the logits from the last block's
    output: ``lm_head``, or the embedding table of a model with tied embeddings; None when the
    model has no such parts where mlx-lm's decoders keep them (``model.norm``)."""
    inner = getattr(model, "language_model", model)  # Gemma-3's text model sits one level down
    norm = getattr(getattr(inner, "model", None), "norm", None)
    if norm is None:
        return None
    layers = quantizable_layers(model)
    prefix = "language_model." if inner is not model else ""
    for path in (f"{prefix}lm_head", f"{prefix}model.embed_tokens"):
        if path in layers:
            return path, layers[path], norm
    return None


HEAD_CHECK_WINDOWS = 2  # calibration windows on which a GPTQ head must beat the RTN one


def _logit_kl(reference: mx.array, logits: mx.array) -> float:
    """Mean KL(reference || logits) per token, float32 ``(..., vocab)`` logits."""
    logp = reference - mx.logsumexp(reference, axis=-1, keepdims=True)
    logq = logits.astype(mx.float32)
    logq = logq - mx.logsumexp(logq, axis=-1, keepdims=True)
    return mx.mean(mx.sum(mx.exp(logp) * (logp - logq), axis=-1)).item()


def _quantize_head(model, plan, calibration: mx.array, hidden: list[mx.array],
                   float_logits: mx.array, damp: float, grid: int, dtype: mx.Dtype
                   ) -> tuple[str, nn.Module, dict] | None:
    """The output head (or the tied embedding table, which is the head too) quantized with GPTQ
    on the Hessian of the final norm's outputs over the calibration tokens, if that beats
    round-to-nearest (clipping ``grid``) on the first calibration windows' logits against the
    float model's (``float_logits``); ``(path, layer, record)`` or None without a head.

    No block sees the head, yet it is a large share of a small model's error (SmolLM2 4-bit g64,
    awq+gptq: KL 0.294 with an RTN head, 0.182 with GPTQ's). A tied table is also looked up as
    the input embedding, where GPTQ's head objective does not count its rows' own error: the
    check keeps RTN where that costs more (a tiny random model at 3 bits). The GPTQ candidate
    judged is fitted without the check windows (when there are others), so that the check is on
    text it did not fit: fitted on them it won where it only fitted them (Gemma-3 8-bit g64:
    held-out KL 0.0035 against RTN's 0.0029); the head kept is then fitted on every window."""
    found = output_head(model)
    if found is None or plan.get(found[0]) is None:
        return None
    path, head, norm = found
    spec = plan[path]
    weight = np.array(head.weight.astype(mx.float32))

    def fitted(skip: int) -> nn.Module:
        """GPTQ on the calibration windows after the first ``skip``."""
        hessian, seen = gptq.Hessian(head.weight.shape[1]), 0
        for x in hidden:  # (windows, tokens, hidden) per calibration chunk, in order
            part = x[max(skip - seen, 0):]
            if part.shape[0]:
                hessian.add(norm(part))
            seen += x.shape[0]
        q, scales, zeros, _ = gptq.quantize(weight, hessian.matrix(), spec.bits,
                                            spec.group_size, damp=damp,
                                            dtype=zp_format.dtype_name(dtype))
        return zero_point_like(head, q, scales, zeros, bits=spec.bits,
                               group_size=spec.group_size, dtype=dtype)

    held_out = calibration.shape[0] > HEAD_CHECK_WINDOWS
    candidates = {"gptq": fitted(HEAD_CHECK_WINDOWS if held_out else 0),
                  "rtn": _rtn_layer(head, spec, grid, dtype)}
    kl = {}
    for name, layer in candidates.items():
        replace_modules(model, {path: layer})
        kl[name] = _logit_kl(float_logits, model(calibration[:HEAD_CHECK_WINDOWS]))
    best = min(kl, key=kl.get)
    if best == "gptq" and held_out:
        candidates["gptq"] = fitted(0)
    record = {"method": best, "damp": damp, "calibration_kl": {k: round(v, 5) for k, v in kl.items()},
              "check": "held-out calibration windows" if held_out else "fitted windows"}
    return path, candidates[best], record


def quantize_model(
    model: nn.Module,
    *,
    bits: int = 4,
    group_size: int = 64,
    method: str = "rtn",
    calibration_tokens=None,
    recipe: dict | str | None = None,
    act_order: bool = False,
    group_fallback: bool = False,
    damp: float = gptq.DEFAULT_DAMP,
    head_damp: float | str | None = "default",
    grid: int | None = None,
    dtype: str | mx.Dtype | None = None,
    progress: bool = False,
) -> tuple[nn.Module, dict[str, Any]]:
    """Quantize ``model`` in place into zero-point layers.

    Args:
        model: an unquantized mlx-lm model.
        bits, group_size: defaults for every layer (see :mod:`mlxspec.quant.zp_format`).
        method: ``"rtn"``, ``"gptq"``, ``"awq"`` or ``"awq+gptq"``.
        calibration_tokens: for the calibrated methods: token windows, ``(n, T)`` ints (list of lists or mx).
        recipe: a recipe dict, or a name/path for :func:`load_recipe`.
        act_order: GPTQ visits columns by decreasing activation (stored with ``perm``; zp only).
        group_fallback: layers whose input size ``group_size`` does not divide use the largest
            supported group size that does, instead of an error.
        head_damp: the GPTQ damping of the output head (a tied embedding table included) for
            ``gptq`` and ``awq+gptq`` where it beats RTN (:func:`_quantize_head`); None leaves the head to
            round-to-nearest; ``"default"`` is the method's (:data:`HEAD_DAMP`). Measured (SmolLM2 4-bit g64, awq+gptq, KL per held-out domain,
            ``docs/quantization-quality.md``): round-to-nearest head 0.303 / 0.320 / 0.256 /
            0.299 (prose / code / chat / technical), GPTQ head at 0.01 0.215 / 0.192 / 0.185 /
            0.137.
        grid: clipping ratios tried per group (1 = min-max); default 1 for rtn, gptq and awq+gptq
            (whose roundings are GPTQ's), 10 for awq (whose search is weighted by the activations; see :mod:`mlxspec.quant.rtn` and
            :data:`mlxspec.quant.awq.DEFAULT_GRID` for the measurements), and 10 for embedding
            tables whatever the method (:data:`EMBEDDING_GRID`).
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``: the dtype of the scales and of
            every unquantized parameter (so of activations and KV cache); default the model's.
            Scales are chosen exact in it (:mod:`mlxspec.quant.zp_format`), so
            :func:`mlxspec.quant.storage.save_quantized` can write MLX's affine layout exactly.
        progress: show a rich progress bar (one step per layer).

    Returns:
        ``(model, quantization)``: the same model object, and the ``quantization`` entry for
        ``config.json`` (``format``, ``method``, ``bits``, ``group_size``, per-layer exceptions in
        ``layers``, ``bits_per_weight``, ...; ``awq_unscaled_blocks`` when awq+gptq left blocks
        unscaled).
    """
    if method not in METHODS:
        raise QuantizationError(f"unknown method {method!r}: choose {', '.join(METHODS)}")
    if isinstance(recipe, (str, Path)):
        recipe = load_recipe(recipe)
    zp_format.check_spec(bits, group_size, group_size)
    if head_damp == "default":
        head_damp = HEAD_DAMP.get(method)
    embedding_grid = EMBEDDING_GRID if grid is None else grid
    if grid is None:
        grid = awq.DEFAULT_GRID if method == "awq" else rtn.DEFAULT_GRID
    dtype = getattr(mx, zp_format.dtype_name(dtype if dtype is not None else model_dtype(model)))
    plan = plan_layers(model, bits, group_size, recipe=recipe, group_fallback=group_fallback)
    calibration = None
    if method in CALIBRATED:
        if calibration_tokens is None:
            raise QuantizationError(f"{method} needs calibration_tokens (see calibration_windows)")
        calibration = mx.array(calibration_tokens)
        if calibration.ndim != 2 or calibration.shape[0] < 1:
            raise QuantizationError("calibration_tokens must be (windows, tokens) token ids")
    layers = quantizable_layers(model)
    todo = [p for p, spec in plan.items() if spec is not None]
    with progress_bar(f"quantizing ({method}, {bits}-bit)", len(todo), progress) as advance:
        done, step, head = set(), None, None
        with_head = (method in ("gptq", "awq+gptq") and head_damp is not None
                     and output_head(model) is not None)
        if with_head:  # the float model's logits, for the head's check
            float_logits = model(calibration[:HEAD_CHECK_WINDOWS]).astype(mx.float32)
            mx.eval(float_logits)
        if calibration is not None:
            step = (gptq.GPTQ(act_order=act_order, damp=damp, grid=grid, dtype=dtype)
                    if method == "gptq" else
                    awq.AWQ(grid=grid, dtype=dtype, damp=damp,
                            rounding="gptq" if method == "awq+gptq" else "rtn",
                            act_order=method == "awq+gptq" and AWQ_GPTQ_ACT_ORDER))
            done, hidden = _calibrated_blocks(model, plan, calibration, step, advance)
            if with_head:
                head = _quantize_head(model, plan, calibration, hidden, float_logits, head_damp,
                                      embedding_grid, dtype)
            if head is not None:
                replace_modules(model, {head[0]: head[1]})
                done.add(head[0])
                advance()
        for path in todo:
            if path not in done:
                layer_grid = (embedding_grid if isinstance(layers[path], nn.Embedding)
                              else grid)
                replace_modules(model, {path: _rtn_layer(layers[path], plan[path], layer_grid,
                                                         dtype)})
                advance()
    cast_floats(model, dtype)
    mx.eval(model.parameters())
    quantization = {
        "format": ZP_FORMAT,  # in memory; save_quantized records the format it writes
        "method": method,
        "dtype": zp_format.dtype_name(dtype),
        "bits": bits,
        "group_size": group_size,
        "act_order": bool(act_order and method == "gptq"),  # stored permuted (zp only)
        "act_order_static_groups": method == "awq+gptq" and AWQ_GPTQ_ACT_ORDER,
        "recipe": (recipe or {}).get("name"),
        "layers": {
            path: None if spec is None else {"bits": spec.bits, "group_size": spec.group_size}
            for path, spec in plan.items()
            if spec != LayerSpec(bits, group_size)
        },
        "bits_per_weight": round(bits_per_weight(model), 4),
    }
    if head is not None:
        quantization["head"] = head[2]
    if getattr(step, "unscaled_blocks", None):  # awq+gptq: blocks AWQ's scales could not fold into
        quantization["awq_unscaled_blocks"] = list(step.unscaled_blocks)
    quantization["mlxspec_version"] = version("mlxspec")
    return model, quantization


def bits_per_weight(model: nn.Module) -> float:
    """Stored bits per model weight: all parameter bytes * 8 / number of weights (as mlx-lm's
    ``compute_bits_per_weight``: norms and biases included, a quantized weight counted once)."""
    from mlx_lm.utils import compute_bits_per_weight

    return float(compute_bits_per_weight(model))
