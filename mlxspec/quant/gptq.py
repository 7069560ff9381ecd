"""GPTQ: quantize a linear layer column by column, feeding each column's rounding error back into
the columns not yet quantized (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization
for Generative Pre-trained Transformers"; the same algorithm as AutoGPTQ and gpt-fast's GPTQ.py).

For a layer ``y = x @ W.T`` and calibration inputs ``X`` (rows are tokens), the output error of a
quantized ``Q`` is ``||X (W - Q).T||^2 = sum_rows (w - q) H (w - q).T`` with ``H = X.T X``. GPTQ
rounds one input column ``i`` at a time and moves the rest of the row to compensate::

    err_i  = (w_i - q_i) / U[i, i]            # U: upper Cholesky factor of H^-1
    w_j   -= err_i * U[i, j]    for j > i     # optimal update of the remaining columns

processed in blocks of 128 columns (lazy batch updates: one matmul per block for the columns after
it). Group scales and zero-points are chosen (with :func:`mlxspec.quant.rtn.find_params`'s clipping
search) when the column loop reaches a group's first column, from the already-updated weights.

``act_order`` visits columns by decreasing ``H[i, i]`` (the most active inputs first, while the
most columns are left to absorb their error). The groups are then consecutive in that order, so the
result is stored permuted: the layer applies ``x[..., perm]`` before the matmul
(:class:`mlxspec.quant.layers.ZeroPointLinear`'s ``perm``), as ExLlama does with GPTQ's ``g_idx``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np

from mlxspec.errors import QuantizationError
from mlxspec.quant import rtn
from mlxspec.quant.layers import zero_point_like
from mlxspec.quant.zp_format import check_spec, dtype_name

BLOCK_SIZE = 128  # columns per lazy-update block; a multiple of every supported group size
SUB_BLOCK_SIZE = 16  # columns per inner block; divides every supported group size
DEFAULT_DAMP = 0.01  # damping, as a fraction of the mean diagonal of H


class Hessian:
    """Accumulates ``H = X.T X`` over calibration inputs of one layer (float32 on the device)."""

    def __init__(self, in_features: int):
        self.sum = mx.zeros((in_features, in_features), dtype=mx.float32)
        self.rows = 0

    def add(self, x: mx.array) -> None:
        """x: ``(..., in_features)`` activations entering the layer."""
        x = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        self.sum = self.sum + x.T @ x
        self.rows += x.shape[0]
        mx.eval(self.sum)

    def matrix(self) -> np.ndarray:
        """``H / rows`` as float64 ``(in, in)``."""
        if self.rows == 0:
            raise QuantizationError("no calibration activations reached this layer")
        return np.array(self.sum, dtype=np.float64) / self.rows


def _inverse_cholesky(h: np.ndarray, damp: float) -> np.ndarray:
    """Upper Cholesky factor ``U`` of ``(H + damp * mean(diag H) * I)^-1``, float32.

    With ``R`` the index reversal, ``chol(R H R) = R U^-1 R``, so one Cholesky factorisation and
    one triangular inverse give U (MLX's LAPACK on the CPU: ~8x faster than numpy here). MLX does
    not report a failed factorisation (LAPACK stops at the first non-positive pivot and leaves
    the rest unfactored), so the factor is checked on random probes -- ``L (L^T V)`` against
    ``A V``, O(n^2) where forming ``L L^T`` cost three factorisations; damping grows tenfold
    until H is positive definite."""
    mean_diag = float(np.mean(np.diag(h)))
    probes = mx.random.normal((h.shape[0], 4), key=mx.random.key(0))
    for _ in range(6):
        damped = mx.array((h + damp * mean_diag * np.eye(h.shape[0]))[::-1, ::-1].astype(np.float32))
        lower = mx.linalg.cholesky(damped, stream=mx.cpu)
        want = damped @ probes
        residual = mx.abs(lower @ (lower.T @ probes) - want).max() / mx.abs(want).max()
        if mx.all(mx.diagonal(lower) > 0).item() and residual.item() < 1e-4:
            return np.array(mx.linalg.tri_inv(lower, stream=mx.cpu))[::-1, ::-1]
        damp *= 10
    raise QuantizationError("the calibration Hessian is not positive definite: use more text")


def quantize(
    weight,
    hessian: np.ndarray,
    bits: int,
    group_size: int,
    *,
    damp: float = DEFAULT_DAMP,
    act_order: bool = False,
    grid: int = rtn.DEFAULT_GRID,
    dtype: str = "float16",
    static_groups: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """GPTQ-quantize one weight matrix.

    Args:
        weight: ``(out_features, in_features)`` float (numpy or mx).
        hessian: float64 ``(in, in)``, ``X.T X / rows`` of the layer's calibration inputs.
        bits, group_size: see :mod:`mlxspec.quant.zp_format`.
        damp: damping of H's diagonal, relative to its mean.
        act_order: quantize columns by decreasing ``H[i, i]`` (the result is column-permuted).
        grid: clipping ratios tried per group (1 = min-max).
        dtype: the model's dtype; scales are exact in it (:func:`mlxspec.quant.rtn.find_params`).
        static_groups: every group's scale and zero-point are chosen up front from the original
            weights (AutoGPTQ's ``static_groups``), so that with ``act_order`` the groups stay in
            the natural column order and no ``perm`` is needed (the result is returned
            unpermuted, ``perm`` None).

    Returns:
        ``(q, scales, zeros, perm)``: uint8 ``(out, in)``, float32 ``(out, in / g)`` (exact in
        ``dtype``), uint8
        ``(out, in / g)``, and ``perm`` (int64 ``(in,)``) or None. With ``perm``, column ``j`` of
        ``q`` quantizes input feature ``perm[j]``: ``y = x[..., perm] @ dequantized.T``.
    """
    w = np.array(weight, dtype=np.float32)
    out_features, in_features = w.shape
    check_spec(bits, group_size, in_features)
    h = np.array(hessian, dtype=np.float64)
    dead = np.diag(h) == 0  # inputs that were always zero: their weights cannot matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    qmax = 2**bits - 1
    n_groups = in_features // group_size
    scales = np.empty((out_features, n_groups), np.float32)
    zeros = np.empty((out_features, n_groups), np.float32)
    if static_groups:
        scales[:], zeros[:] = rtn.find_params(w.reshape(out_features, n_groups, group_size), bits,
                                              grid=grid, dtype=dtype)
    perm = None
    if act_order:
        perm = np.argsort(-np.diag(h), kind="stable")
        w, h = w[:, perm], h[perm][:, perm]
    group_of = (np.arange(in_features) if perm is None else perm) // group_size
    u = np.ascontiguousarray(_inverse_cholesky(h, damp))

    # Columns are walked as rows of W.T (contiguous). Lazy updates on two levels: a column's
    # error reaches the rest of its sub-block at once (rank-1), the rest of its block once per
    # sub-block and the later blocks once per block (matrix products). A group starts on a
    # sub-block boundary, so its parameters are chosen from fully updated weights: the same
    # algorithm as one rank-1 update per column.
    wt, qt = np.ascontiguousarray(w.T), np.empty((in_features, out_features), np.uint8)
    for i1 in range(0, in_features, BLOCK_SIZE):
        i2 = min(i1 + BLOCK_SIZE, in_features)
        block = wt[i1:i2].copy()
        errors = np.zeros_like(block)
        for j1 in range(0, i2 - i1, SUB_BLOCK_SIZE):
            j2 = min(j1 + SUB_BLOCK_SIZE, i2 - i1)
            for j in range(j1, j2):
                col = i1 + j
                if static_groups:  # chosen up front; the column's own group, wherever visited
                    s, z = scales[:, group_of[col]], zeros[:, group_of[col]]
                elif col % group_size == 0:  # a new group starts: pick its parameters now
                    s, z = rtn.find_params(block[j : j + group_size].T, bits, grid=grid,
                                           dtype=dtype)
                    scales[:, col // group_size], zeros[:, col // group_size] = s, z
                qcol = np.rint(block[j] / s)
                qcol += z
                np.clip(qcol, 0, qmax, out=qcol)
                qt[col] = qcol
                err = (block[j] - s * (qcol - z)) / u[col, col]
                block[j + 1 : j2] -= np.outer(u[col, col + 1 : i1 + j2], err)
                errors[j] = err
            block[j2:] -= u[i1 + j1 : i1 + j2, i1 + j2 : i2].T @ errors[j1:j2]
        wt[i2:] -= u[i1:i2, i2:].T @ errors
    q = np.ascontiguousarray(qt.T)
    if static_groups and perm is not None:  # back to the natural column order
        natural = np.empty_like(q)
        natural[:, perm] = q
        q, perm = natural, None
    return q, scales, zeros.astype(np.uint8), perm


@dataclass
class GPTQ:
    """GPTQ on every planned linear of a decoder block: the
    :class:`mlxspec.quant.calibrate.BlockQuantizer` step of ``--method gptq``."""

    act_order: bool = False
    damp: float = DEFAULT_DAMP
    grid: int = rtn.DEFAULT_GRID
    dtype: mx.Dtype = mx.float16
    needs_norms: ClassVar[bool] = False

    def quantize_block(self, block, prefix: str, targets: dict, recorders: dict, plan: dict,
                       check: tuple) -> dict:
        quantized = {}
        for name, module in targets.items():
            spec = plan[f"{prefix}.{name}"]
            q, scales, zeros, perm = quantize(
                np.array(module.weight.astype(mx.float32)), recorders[name].hessian.matrix(),
                spec.bits, spec.group_size, damp=self.damp, act_order=self.act_order, grid=self.grid,
                dtype=dtype_name(self.dtype),
            )
            quantized[name] = zero_point_like(module, q, scales, zeros, bits=spec.bits,
                                              group_size=spec.group_size, perm=perm, dtype=self.dtype)
        return quantized
