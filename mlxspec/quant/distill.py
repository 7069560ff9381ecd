"""Distillation of the scales: after any method, tune each group's scale so that the quantized
model's next-token distributions match the float model's on the calibration text.

This is mlx-lm's DWQ (``mlx_lm.quant.dwq.dwq_quantize``: its loss -- KL at temperature 2 over
the teacher's 1024 most likely tokens at each position, computed once per window as mlx-lm's
stored targets are --, Adam and training loop, reused as they are) with two differences that
keep mlxspec's format:

- only the scales ``s`` train. The integers ``q`` and the integer zero-points ``z`` stay as the
  quantizer chose them (DWQ also trains a free bias per group, which would lose the integer
  zero-point of ``w = s * (q - z)`` and with it the exact affine encoding and mlxspec's kernels);
- the scales train through the rounding to the values exact in the model's dtype
  (:func:`mlxspec.quant.zp_format.round_scales`; a straight-through estimator: the forward pass
  uses the rounded scale, the gradient moves the float32 one), so what is trained is what is
  stored.

During training each quantized layer is a :class:`_ScaleTrainable` twin computing
``x @ (s * (q - z)).T`` densely in float32 (differentiable in ``s``, and through BLAS where MLX's
CPU ``quantized_matmul`` has none); afterwards the zero-point layers get their new scales back.
mlx-lm trains only layers under 8 bits, and so does this (8-bit layers are nearly lossless).

The result is kept only if it is better: the KL against the float model on held-out windows of
the calibration text (not trained on) is measured before and after, and worse scales are
thrown away (recorded as ``"kept": false``).
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optimizers
import numpy as np

from mlxspec.errors import QuantizationError
from mlxspec.progress import progress_bar
from mlxspec.quant import zp_format
from mlxspec.quant.layers import ZeroPointEmbedding, replace_modules, zero_point_modules

MAX_WINDOWS = 256  # of the calibration text (the built-in one has 29)
WINDOW_TOKENS = 513  # tokens per training window (mlx-lm: 512 "still gets good results", + 1)
BATCH_SIZE = 4  # windows per step (mlx-lm's default)
VALID_WINDOWS = 4  # windows held out of training to judge the result (one batch)
DEFAULT_EPOCHS = 8  # passes over the training windows
# Adam's step for the scales. mlx-lm's default run is 512 steps at 1e-6; the built-in calibration
# text gives ~50 steps in 8 epochs, so the rate is scaled to keep rate x steps.
DEFAULT_LEARNING_RATE = 1e-5
TEMPERATURE = 2.0  # mlx-lm's DWQ temperature
# The teacher's logits kept per position, computed once per window (mlx-lm's DWQ targets, as
# its --target-dir stores them): the loss is the KL over these, so a 262k-token vocabulary costs
# a 1024-wide softmax, and the teacher runs once instead of once per epoch.
TOP_K = 1024


def _rounded(s: mx.array, bits: int, dtype: str) -> mx.array:
    """``s`` rounded as :func:`zp_format.round_scales` rounds it, in MLX, with the gradient of
    the identity (straight-through): float32 ``s`` -> float32."""
    precision, smallest = zp_format.PRECISION[dtype]
    k = zp_format.scale_bits(bits, dtype)
    if k >= precision:
        return s
    clipped = mx.maximum(s, smallest)
    unit = mx.power(2.0, mx.floor(mx.log2(clipped)) + 1 - k)
    return s + mx.stop_gradient(mx.round(clipped / unit) * unit - s)


class _ScaleTrainable(nn.Module):
    """A zero-point layer during distillation: ``scales`` (float32, trainable) times the frozen
    ``q - z``. Has the attributes mlx-lm's DWQ looks for (``bits``, ``group_size``,
    ``mode="affine"``, a packed ``weight`` to count parameters)."""

    def __init__(self, layer: nn.Module, dtype: str):
        super().__init__()
        self.bits, self.group_size, self.mode = layer.bits, layer.group_size, "affine"
        self.scale_dtype = dtype
        self.is_embedding = isinstance(layer, ZeroPointEmbedding)
        n_groups = layer.in_features // layer.group_size
        q = zp_format.unpack(layer.weight, layer.bits, layer.in_features).astype(mx.float32)
        z = zp_format.unpack(layer.zeros, layer.bits, n_groups).astype(mx.float32)
        self.q_minus_z = (q.reshape(-1, n_groups, layer.group_size) - z[..., None])
        self.weight = layer.weight
        self.scales = layer.scales.astype(mx.float32)
        for name in ("bias", "perm"):
            if name in layer:
                setattr(self, name, layer[name])
        self.freeze()

    def dense(self) -> mx.array:
        """``(out, in)`` float32: ``s * (q - z)`` with the scales rounded as they will be stored."""
        s = _rounded(self.scales, self.bits, self.scale_dtype)
        w = self.q_minus_z * s[..., None]
        return w.reshape(w.shape[0], -1)

    def __call__(self, x: mx.array) -> mx.array:
        if self.is_embedding:
            return self.dense()[x]
        if "perm" in self:
            x = mx.take(x, self["perm"], axis=-1)
        y = x @ self.dense().T
        return y + self["bias"] if "bias" in self else y

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.dense().T


def _teacher_targets(teacher: nn.Module, windows: list[list[int]], top_k: int, advance
                     ) -> dict[bytes, tuple[mx.array, mx.array | None]]:
    """Per window, keyed by the bytes of its input tokens ``window[:-1]``: the teacher's
    ``top_k`` largest logits ``(T - 1, k)`` float32 and their token ids (None: all of them)."""
    targets = {}
    for window in windows:
        inputs = np.array(window[:-1], np.int32)
        if inputs.tobytes() in targets:
            continue
        logits = teacher(mx.array(inputs)[None])[0].astype(mx.float32)
        ids = None
        if logits.shape[-1] > top_k:
            # A slice is a view of argpartition's whole (T - 1, vocab) result: copied out, or
            # every stored window keeps it alive (Gemma-3: 537 MB a window, 29 windows -> OOM).
            ids = mx.contiguous(mx.argpartition(logits, kth=-top_k, axis=-1)[..., -top_k:])
            logits = mx.take_along_axis(logits, ids, axis=-1)
        mx.eval(logits, ids)
        targets[inputs.tobytes()] = (logits, ids)
        advance()
    return targets


def _kl(student: nn.Module, teacher: nn.Module, windows: list[list[int]]) -> float:
    """Mean KL(teacher || student) per predicted token over ``windows`` (temperature 1)."""
    total, count = 0.0, 0
    for window in windows:
        ids = mx.array([window[:-1]])
        logp = nn.log_softmax(teacher(ids).astype(mx.float32), axis=-1)
        logq = nn.log_softmax(student(ids).astype(mx.float32), axis=-1)
        kl = (mx.exp(logp) * (logp - logq)).sum(-1)
        total, count = total + float(kl.sum()), count + kl.size
    return total / count


def check_windows(windows: list[list[int]], batch_size: int = BATCH_SIZE) -> None:
    """Raise QuantizationError unless there are enough windows to train and to judge."""
    if len(windows) < VALID_WINDOWS + batch_size:
        raise QuantizationError(
            f"distillation needs at least {VALID_WINDOWS + batch_size} calibration windows of "
            f"{len(windows[0]) if windows else WINDOW_TOKENS} tokens, the text gave "
            f"{len(windows)}: give a longer --calibration text"
        )


def distill_scales(
    model: nn.Module,
    teacher: nn.Module,
    windows: list[list[int]],
    *,
    dtype: str | mx.Dtype,
    epochs: int = DEFAULT_EPOCHS,
    learning_rate: float = DEFAULT_LEARNING_RATE,
    batch_size: int = BATCH_SIZE,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Tune the scales of ``model``'s zero-point layers (under 8 bits) in place by distillation
    from ``teacher``; keep them only if held-out KL improves.

    Args:
        model: a model quantized by :func:`mlxspec.quant.quantize.quantize_model` (zero-point
            layers), before it is saved.
        teacher: the float model it was quantized from (same tokenizer), unchanged.
        windows: token windows of the calibration text, ``(n, T)`` ids; the last
            :data:`VALID_WINDOWS` are held out, the rest trained on ``epochs`` times.
        dtype: the dtype the scales are stored in (they train through its rounding).
        epochs, learning_rate, batch_size, seed: the training (Adam, mlx-lm's DWQ loop).
        progress: a progress bar, one step per training batch.

    Returns:
        the record for the ``quantization`` entry: epochs, steps, learning rate, windows and
        their tokens, ``kl_before``/``kl_after`` on the held-out windows, ``kept``, seconds.
    """
    from mlx_lm.quant.dwq import dwq_quantize

    dtype = zp_format.dtype_name(dtype)
    if epochs < 1:
        raise QuantizationError(f"distillation needs at least one epoch, not {epochs}")
    check_windows(windows, batch_size)
    layers = zero_point_modules(model)
    trained = {p: m for p, m in layers.items() if m.bits < 8}
    if not trained:
        raise QuantizationError("distillation trains layers under 8 bits: there are none")
    valid, train = windows[-VALID_WINDOWS:], windows[:-VALID_WINDOWS]
    start = time.perf_counter()
    before = _kl(model, teacher, valid)
    twins = {p: _ScaleTrainable(m, dtype) for p, m in layers.items()}
    for layer in layers.values():
        layer.drop_derived()  # its float32 copy on the CPU path, while the twin trains
    replace_modules(model, twins)
    steps = len(train) * epochs // batch_size
    with progress_bar(f"distilling scales ({steps} steps)", len(windows) + steps,
                      progress) as advance:
        cached = _teacher_targets(teacher, windows, TOP_K, advance)
        started = []

        def targets(batch: mx.array, _index: int, split: str):
            if split == "train":
                if started:
                    advance()  # the previous step has finished
                started.append(True)
            rows = [cached[row.tobytes()] for row in np.array(batch, np.int32)]
            logits = mx.stack([r[0] for r in rows])
            return logits if rows[0][1] is None else (logits, mx.stack([r[1] for r in rows]))

        # mlx-lm's loop prints (trainable parameters, a tqdm bar, validation losses): mlxspec
        # shows its own bar and measures the result itself.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            dwq_quantize(
                model, targets, optimizers.Adam(learning_rate=learning_rate, bias_correction=True),
                [(w, 0) for w in train] * epochs, [(w, 0) for w in valid],
                batch_size=batch_size, max_seq_length=len(windows[0]), seed=seed,
                dtype=mx.float32, temperature=TEMPERATURE,
            )
        advance()
    model.eval()
    replace_modules(model, layers)
    originals = {p: m.scales for p, m in trained.items()}
    for path, layer in trained.items():
        s = zp_format.round_scales(np.array(twins[path].scales), layer.bits, dtype)
        layer.scales = mx.array(s).astype(getattr(mx, dtype))
    mx.eval([m.scales for m in trained.values()])
    after = _kl(model, teacher, valid)
    kept = math.isfinite(after) and after < before
    if not kept:
        for path, layer in trained.items():
            layer.scales = originals[path]
    return {
        "epochs": epochs, "steps": steps, "learning_rate": learning_rate,
        "batch_size": batch_size, "windows": len(train), "window_tokens": len(windows[0]),
        "valid_windows": len(valid), "temperature": TEMPERATURE, "top_k": TOP_K,
        "kl_before": round(before, 6), "kl_after": round(after, 6), "kept": kept,
        "seconds": round(time.perf_counter() - start, 1),
    }
