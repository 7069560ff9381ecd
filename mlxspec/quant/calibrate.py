"""Calibration: the text windows run through the model, and what each decoder block sees.

The calibrated methods (GPTQ, AWQ) walk the model block by block, as AutoGPTQ and gpt-fast do:
the calibration windows are run through the embedding once (:func:`block_inputs`), then through
one block at a time; :func:`record_block` gives each target linear of the block the Hessian
``X.T X`` of its inputs (linears fed the same array share one) and the name of the norm that
produced that input, if any. Memory holds one block's activations and Hessians.

A method plugs in as a :class:`BlockQuantizer` (gpt-fast's ``QuantHandler`` in miniature):
``quantize_block(block, prefix, targets, recorders, plan, check) -> {name: new layer}``.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from mlxspec.errors import QuantizationError
from mlxspec.quant.gptq import Hessian
from mlxspec.quant.layers import replace_modules

DEFAULT_CALIBRATION_WINDOWS = 32
DEFAULT_CALIBRATION_TOKENS = 256  # tokens per calibration window
CALIBRATION_BATCH = 4  # windows run through a block at a time


class BlockQuantizer(Protocol):
    """One calibrated method's step on one decoder block."""

    needs_norms: bool  # record which norm produced each linear's input (AWQ folds into it)

    def quantize_block(self, block: nn.Module, prefix: str, targets: dict, recorders: dict,
                       plan: dict, check: tuple) -> dict[str, nn.Module]:
        """The replacement layers for ``targets`` (name -> linear inside ``block``), given
        ``recorders[name].hessian`` / ``.source``, the layer ``plan`` (full path -> LayerSpec)
        and ``check = (first input batch, args, kwargs)`` of the block."""
        ...


def builtin_calibration_path() -> Path:
    """The one-author calibration text shipped with the package (``mlxspec/data/calibration.txt``,
    Jane Austen; see ``data/PROVENANCE.md``): one of the prose sources of the built-in set
    (:mod:`mlxspec.quant.calibration_set`), and the set mlxspec used before it."""
    return Path(str(resources.files("mlxspec") / "data" / "calibration.txt"))


def calibration_windows(
    tokenizer,
    path: str | Path | None = None,
    *,
    windows: int = DEFAULT_CALIBRATION_WINDOWS,
    window_tokens: int = DEFAULT_CALIBRATION_TOKENS,
    model: nn.Module | None = None,
    conversations: list | None = None,
    mix: dict[str, float] | None = None,
) -> tuple[list[list[int]], str]:
    """Token windows of a calibration text and a sha256 that identifies them.

    Args:
        tokenizer: has ``encode(text, add_special_tokens=False)``.
        path: a UTF-8 text file (consecutive windows from its start); None for the built-in
            multi-domain set (:func:`mlxspec.quant.calibration_set.mixed_windows`).
        windows: at most this many windows (fewer if the text is shorter).
        window_tokens: tokens per window.
        model, conversations, mix: the built-in set only: the float model that answers the
            built-in prompts (its chat domain; None leaves it out unless ``conversations``, already
            generated, are given) and the share of windows per domain.

    Returns:
        ``(windows, sha256 hex)``: of the file's bytes, or of the built-in set's token windows.
    """
    if path is None:
        from mlxspec.quant.calibration_set import mixed_windows

        out, record = mixed_windows(tokenizer, model, conversations=conversations,
                                    windows=windows, window_tokens=window_tokens, mix=mix)
        return out, record["calibration_sha256"]
    path = Path(path)
    if not path.is_file():
        raise QuantizationError(f"calibration text not found: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QuantizationError(f"{path} is not UTF-8 text: {e.reason}") from e
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    count = min(windows, len(ids) // window_tokens)
    if count < 1:
        raise QuantizationError(
            f"{path} holds {len(ids)} tokens, fewer than one calibration window of "
            f"{window_tokens}: give a longer text"
        )
    out = [ids[i * window_tokens : (i + 1) * window_tokens] for i in range(count)]
    return out, hashlib.sha256(data).hexdigest()


class _StopForward(Exception):
    """Raised by the last block's catcher: the rest of the forward pass is not needed."""


class _Catcher:
    """Stands in for a decoder block during one forward pass and records how it is called."""

    def __init__(self, block, record: list, stop: bool):
        self.block, self.record, self.stop = block, record, stop

    def __getattr__(self, name):  # models read block attributes (e.g. llama's use_sliding)
        return getattr(self.block, name)

    def __call__(self, x, *args, **kwargs):
        self.record.append((x, args, kwargs))
        if self.stop:
            raise _StopForward
        return x


def block_inputs(model: nn.Module, tokens: mx.array) -> tuple[mx.array, list]:
    """The first block's input ``(batch, T, hidden)`` for ``tokens`` ``(batch, T)``, and the extra
    arguments (mask, cache) the model passes to each block."""
    blocks = model.layers
    records = [[] for _ in blocks]
    originals = list(blocks)
    try:
        for i, block in enumerate(originals):
            blocks[i] = _Catcher(block, records[i], stop=i == len(blocks) - 1)
        model(tokens)
    except _StopForward:
        pass
    finally:
        for i, block in enumerate(originals):
            blocks[i] = block
    if any(len(r) != 1 for r in records):
        raise QuantizationError(
            "this model does not call its decoder blocks one after another: use --method rtn"
        )
    return records[0][0][0], [(args, kwargs) for _, args, kwargs in (r[0] for r in records)]


class _SharedInputs:
    """The arrays seen during one block call: linears fed the same array (q/k/v, gate/up) share
    one Hessian instead of accumulating identical ones, and remember which norm produced it."""

    def __init__(self):
        self.seen: dict[int, tuple[mx.array, Hessian]] = {}
        self.produced: dict[int, tuple[mx.array, str]] = {}  # a norm's output -> the norm's name

    def clear(self) -> None:
        self.seen.clear()
        self.produced.clear()


class InputRecorder(nn.Module):
    """Wraps a linear layer; adds each input to the layer's (possibly shared) Hessian and notes
    the norm (if any) that produced the input."""

    def __init__(self, linear: nn.Module, shared: _SharedInputs):
        super().__init__()
        self.linear = linear
        self.shared = shared
        self.hessian: Hessian | None = None
        self.source: str | None = None

    def __call__(self, x):
        seen = self.shared.seen.get(id(x))
        if seen is not None and seen[0] is x:
            self.hessian = seen[1]
        else:
            self.hessian = self.hessian or Hessian(x.shape[-1])
            self.hessian.add(x)
            self.shared.seen[id(x)] = (x, self.hessian)
        produced = self.shared.produced.get(id(x))
        self.source = produced[1] if produced is not None and produced[0] is x else None
        return self.linear(x)


class _OutputRecorder(nn.Module):
    """Wraps a norm; remembers the arrays it returns (AWQ folds scales into their producer)."""

    def __init__(self, norm: nn.Module, name: str, shared: _SharedInputs):
        super().__init__()
        self.norm, self.name, self.shared = norm, name, shared

    def __call__(self, x):
        y = self.norm(x)
        self.shared.produced[id(y)] = (y, self.name)
        return y


def _norms(block: nn.Module) -> dict[str, nn.Module]:
    """The block's normalisation layers (a 1-D ``weight`` and "norm" in the class name)."""
    return {
        name: m for name, m in block.named_modules()
        if "norm" in type(m).__name__.lower() and "weight" in m and m.weight.ndim == 1
    }


def record_block(block, targets, hidden, args, kwargs, track_norms: bool
                  ) -> dict[str, InputRecorder]:
    """Run ``hidden`` through ``block`` and return a Hessian recorder per target linear (which
    also names the norm that produced its input, with ``track_norms``)."""
    shared = _SharedInputs()
    recorders = {name: InputRecorder(m, shared) for name, m in targets.items()}
    norms = _norms(block) if track_norms else {}
    replace_modules(block, {**recorders,
                            **{n: _OutputRecorder(m, n, shared) for n, m in norms.items()}})
    try:
        for x in hidden:
            mx.eval(block(x, *args, **kwargs))
            shared.clear()
    finally:
        replace_modules(block, {**targets, **norms})
    return recorders
