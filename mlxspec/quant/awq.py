"""AWQ: activation-aware per-channel scaling before round-to-nearest (Lin et al., 2023, "AWQ:
Activation-aware Weight Quantization for LLM Compression and Acceleration").

A few input channels carry much larger activations than the rest; their weights matter more.
Scaling input channel ``j`` of a linear by ``s_j > 1`` (and the layer's input by ``1 / s_j``)
leaves the float function unchanged but gives those weights finer quantization steps relative to
their group. The ``1 / s`` is folded into the op that produces the input, so nothing is added at
inference time:

- an RMSNorm feeding q/k/v (or gate/up): its weight is divided by ``s`` (all the linears reading
  that norm's output share one ``s``); a Gemma-style ``1 + weight`` norm is handled;
- ``up_proj`` feeding ``down_proj`` through ``act(gate) * up``: up's output rows are divided.

Other linears (e.g. ``o_proj``, whose input is the attention output) are not scaled. For each
group of linears the scales are ``s = a ** alpha`` with ``a`` the RMS of each input channel over
the calibration tokens (``sqrt(diag H)``, H = ``X.T X / rows``), normalised to geometric mean 1,
and ``alpha`` in ``[0, 1)`` is chosen on a grid to minimise the output error of the group,

    sum over the group's layers of  tr(dW H dW.T),   dW = W - deq(rtn(W * s)) / s,

so ``alpha = 0`` (plain RTN) is always a candidate. The search rounds min-max; the chosen scales
are kept only if they still lower that error with the final quantizer (:func:`scaling_helps`).
The quantized weights then come from
:func:`mlxspec.quant.rtn.quantize` with the clipping search weighted by each column's activation
energy (``diag H / s**2``), or, with ``rounding="gptq"`` (``--method awq+gptq``), from GPTQ on the
scaled weights with the scaled inputs' Hessian ``H / (s s.T)``: the scales decide how fine each
channel's steps are, GPTQ's error feedback then chooses the roundings. Folding is checked: the
float block must give the same outputs after it, else ``awq`` stops with an error naming the
block and ``awq+gptq`` restores the block and gives it plain GPTQ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlxspec.errors import QuantizationError
from mlxspec.quant import gptq, rtn
from mlxspec.quant.layers import zero_point_like
from mlxspec.quant.zp_format import dtype_name

ALPHAS = np.arange(20) / 20  # the grid of exponents searched (as AutoAWQ)
# Clipping ratios of the final importance-weighted RTN. Unlike plain RTN's unweighted search, the
# activation-weighted one helps on unseen text too (SmolLM2 4-bit g64, KL on the evaluation text /
# a licence text: grid 1 0.315 / 0.357, grid 10 0.311 / 0.322).
DEFAULT_GRID = 10
SEARCH_ROWS = 512  # output rows per layer that the search scores (evenly spaced; all if fewer)


def _dequantized(w: np.ndarray, bits: int, group_size: int, dtype: str) -> np.ndarray:
    """Round-to-nearest (min-max; the clipping search comes after) and back, float32."""
    out_features, in_features = w.shape
    groups = w.reshape(out_features, -1, group_size)
    s, z = rtn.find_params(groups, bits, grid=1, dtype=dtype)
    q = rtn.quantize_with(groups, s, z, bits)
    return (s[..., None] * (q - z[..., None])).reshape(out_features, in_features)


def output_error(w: np.ndarray, w_hat: np.ndarray, hessian: np.ndarray) -> float:
    """``tr((w - w_hat) H (w - w_hat).T)``: the layer's mean squared output error per token."""
    d = (w - w_hat).astype(np.float32)
    return float(np.sum((d @ hessian.astype(np.float32, copy=False)) * d))


def _scored_rows(weights: list[np.ndarray]) -> list[np.ndarray]:
    """At most about ``SEARCH_ROWS`` evenly spaced rows of each matrix. Rows are independent terms
    of the output error, so a strided subset ranks candidate scales as well, faster."""
    return [w[:: max(1, w.shape[0] // SEARCH_ROWS)] for w in weights]


def search_scales(
    weights: list[np.ndarray], hessian: np.ndarray, bits: int, group_size: int,
    dtype: str = "float16",
) -> tuple[np.ndarray, float, float]:
    """The per-input-channel scales for linears sharing one input.

    Args:
        weights: float32 ``(out_i, in)`` matrices of the linears reading the same input.
        hessian: float64 ``(in, in)``, ``X.T X / rows`` of that input.
        bits, group_size: the quantization the scales are searched for.
        dtype: the model's dtype (the quantizer's scales are exact in it).

    Returns:
        ``(s, alpha, error ratio)``: float32 ``(in,)`` scales (multiply the weights' columns,
        divide the input), the chosen exponent, and the group's output error with ``s`` relative
        to plain RTN (``<= 1``), scored on at most ``SEARCH_ROWS`` rows of each matrix.
    """
    weights = _scored_rows(weights)
    hessian32 = hessian.astype(np.float32)
    rms = np.sqrt(np.maximum(np.diag(hessian), 0)).astype(np.float32)
    rms = np.maximum(rms, rms.max() * 1e-4 + 1e-12)  # dead channels: keep scales finite
    errors = []
    for alpha in ALPHAS:
        s = rms**alpha
        s = s / np.sqrt(s.max() * s.min())
        err = sum(
            output_error(w, _dequantized(w * s, bits, group_size, dtype) / s, hessian32) for w in weights
        )
        errors.append((err, alpha, s))
    best = min(errors, key=lambda e: e[0])
    return best[2].astype(np.float32), float(best[1]), best[0] / max(errors[0][0], 1e-30)


def scaling_helps(
    weights: list[np.ndarray], hessian: np.ndarray, s: np.ndarray, bits: int, group_size: int,
    grid: int = DEFAULT_GRID, dtype: str = "float16",
) -> bool:
    """Whether ``s`` lowers the group's output error once the final quantizer (the clipping
    search, importance-weighted) is used: the search scores min-max rounding, so this check keeps
    AWQ from ever doing worse than plain RTN on the same objective."""
    weights = _scored_rows(weights)
    hessian32 = hessian.astype(np.float32)
    energy = np.diag(hessian).astype(np.float32)

    def error(scale: np.ndarray) -> float:
        total = 0.0
        for w in weights:
            q, scales, zeros = rtn.quantize(w * scale, bits, group_size, grid=grid,
                                            importance=energy / scale**2, dtype=dtype)
            groups = q.reshape(q.shape[0], -1, group_size).astype(np.float32) - zeros[..., None]
            w_hat = (groups * scales.astype(np.float32)[..., None]).reshape(w.shape) / scale
            total += output_error(w, w_hat, hessian32)
        return total

    return error(s) < error(np.ones_like(s))


def norm_offset(norm: nn.Module) -> float:
    """``c`` such that the norm multiplies by ``weight + c`` (0 for RMSNorm, 1 for Gemma's)."""
    hidden = norm.weight.shape[0]
    y = norm(mx.ones((1, hidden), mx.float32)).astype(mx.float32)[0]  # rms 1: y = w_eff
    eps = float(getattr(norm, "eps", 0.0))
    effective = np.array(y, np.float64) * np.sqrt(1 + eps)
    offsets = effective - np.array(norm.weight.astype(mx.float32), np.float64)
    c = float(np.round(np.median(offsets)))
    if np.max(np.abs(offsets - c)) > 1e-2 * (1 + np.max(np.abs(effective))):
        raise QuantizationError(f"{type(norm).__name__} is not a scaled RMSNorm: use --method gptq")
    return c


def fold_into_norm(norm: nn.Module, s: np.ndarray) -> None:
    """Divide the norm's effective weight (and bias, if any) by ``s`` in place."""
    c = norm_offset(norm)
    dtype = norm.weight.dtype
    weight = np.array(norm.weight.astype(mx.float32), np.float64)
    norm.weight = mx.array(((weight + c) / s - c).astype(np.float32)).astype(dtype)
    if "bias" in norm:
        norm.bias = (norm.bias.astype(mx.float32) / mx.array(s)).astype(norm.bias.dtype)


def fold_into_rows(linear: nn.Module, s: np.ndarray) -> None:
    """Divide the linear's output rows (and bias) by ``s`` in place."""
    inv = mx.array(1.0 / s)
    linear.weight = (linear.weight.astype(mx.float32) * inv[:, None]).astype(linear.weight.dtype)
    if "bias" in linear:
        linear.bias = (linear.bias.astype(mx.float32) * inv).astype(linear.bias.dtype)


def scale_columns(linear: nn.Module, s: np.ndarray) -> None:
    """Multiply the linear's input columns by ``s`` in place."""
    scaled = linear.weight.astype(mx.float32) * mx.array(s)[None, :]
    linear.weight = scaled.astype(linear.weight.dtype)


@dataclass
class AWQ:
    """The :class:`mlxspec.quant.calibrate.BlockQuantizer` step of ``--method awq``: search and
    fold scales for each group of linears sharing an input, check the float block is unchanged,
    then quantize with importance-weighted RTN (``rounding="rtn"``) or GPTQ (``"gptq"``). With
    GPTQ rounding, a block whose scales cannot be folded is restored and quantized with plain
    GPTQ (named in ``unscaled_blocks``); with RTN rounding it is an error."""

    grid: int = DEFAULT_GRID
    dtype: mx.Dtype = mx.float16
    rounding: str = "rtn"
    damp: float = gptq.DEFAULT_DAMP
    act_order: bool = False  # GPTQ rounding: columns by decreasing activation, static groups
    unscaled_blocks: list[str] = field(default_factory=list)  # awq+gptq blocks left unscaled
    needs_norms: ClassVar[bool] = True

    def quantize_block(self, block, prefix: str, targets: dict, recorders: dict, plan: dict,
                       check: tuple) -> dict:
        saved = tree_flatten(block.parameters())
        try:
            hessians = self._scale(block, prefix, targets, recorders, plan, check)
        except QuantizationError:
            if self.rounding != "gptq":
                raise
            # awq+gptq is the default method: a block whose scales cannot be folded gets plain
            # GPTQ (its float weights restored) instead of stopping the whole quantization
            block.update(tree_unflatten(saved))
            hessians = {name: recorders[name].hessian.matrix() for name in targets}
            self.unscaled_blocks.append(prefix)
        quantized = {}
        # an unscaled block gets exactly plain GPTQ (natural column order)
        act_order = self.act_order and prefix not in self.unscaled_blocks
        for name, module in targets.items():
            spec, w = plan[f"{prefix}.{name}"], np.array(module.weight.astype(mx.float32))
            if self.rounding == "gptq":
                q, scales, zeros, _ = gptq.quantize(w, hessians[name], spec.bits, spec.group_size,
                                                    damp=self.damp, grid=self.grid,
                                                    dtype=dtype_name(self.dtype),
                                                    act_order=act_order,
                                                    static_groups=act_order)
            else:
                q, scales, zeros = rtn.quantize(
                    w, spec.bits, spec.group_size, grid=self.grid,
                    importance=np.diag(hessians[name]).astype(np.float32),
                    dtype=dtype_name(self.dtype))
            quantized[name] = zero_point_like(module, q, scales, zeros, bits=spec.bits,
                                              group_size=spec.group_size, dtype=self.dtype)
        return quantized

    def _scale(self, block, prefix: str, targets: dict, recorders: dict, plan: dict,
               check: tuple) -> dict[str, np.ndarray]:
        """Search and fold the scales of each group of targets sharing an input; returns each
        target's input Hessian as the scaled weights see it (``H / (s s.T)``, or H unscaled)."""
        modules = dict(block.named_modules())
        groups: dict[int, list[str]] = {}
        for name in targets:
            groups.setdefault(id(recorders[name].hessian), []).append(name)
        x, args, kwargs = check
        before = block(x, *args, **kwargs)
        hessians = {}
        for names in groups.values():
            h = recorders[names[0]].hessian.matrix()
            source, fold = recorders[names[0]].source, None
            if source is not None:
                fold = partial(fold_into_norm, modules[source])
            elif len(names) == 1 and names[0].endswith("down_proj"):
                up = modules.get(names[0][: -len("down_proj")] + "up_proj")
                fold = None if up is None else partial(fold_into_rows, up)
            hessians.update({n: h for n in names})  # divided by s s.T if scaled below
            if fold is None:
                continue
            specs = [plan[f"{prefix}.{n}"] for n in names]
            weights = [np.array(targets[n].weight.astype(mx.float32)) for n in names]
            bits, group_size = min(sp.bits for sp in specs), max(sp.group_size for sp in specs)
            s, _, _ = search_scales(weights, h, bits, group_size, dtype_name(self.dtype))
            if not scaling_helps(weights, h, s, bits, group_size, self.grid, dtype_name(self.dtype)):
                continue
            fold(s)
            s64 = s.astype(np.float64)
            scaled = h / np.outer(s64, s64)  # one array for the group (in x in float64 each)
            for n in names:
                scale_columns(targets[n], s)
                hessians[n] = scaled
        after = block(x, *args, **kwargs)
        drift = (mx.linalg.norm((after - before).astype(mx.float32))
                 / mx.linalg.norm(before.astype(mx.float32))).item()
        if not drift < 1e-2:
            raise QuantizationError(
                f"AWQ scaling changed the float outputs of {prefix} (relative {drift:.2g}): this "
                "architecture is not supported by --method awq; use --method gptq"
            )
        return hessians
