"""Quantize a whole model into the zero-point format, in memory, and save it.

    model, quantization = quantize_model(model, bits=4, group_size=64, method="gptq",
                                         calibration_tokens=calibration_windows(tokenizer)[0])
    save_quantized(model, "out", config=config, quantization=quantization, source_dir=src)

(``save_quantized`` lives in :mod:`mlxspec.quant.storage`.)

Which layers get which bits is a *plan*: every ``nn.Linear`` and ``nn.Embedding`` (a tied output
head is the embedding) at ``bits``/``group_size``, unless a recipe rule says otherwise
(:func:`load_recipe`; JSON files in ``models/``, installed as ``mlxspec.recipes``).

Methods:

- ``rtn``: round-to-nearest with a per-group clipping search (:mod:`mlxspec.quant.rtn`).
- ``gptq``: the decoder blocks' linears with GPTQ (:mod:`mlxspec.quant.gptq`), layer by layer as
  AutoGPTQ and gpt-fast do: the calibration windows are run through the embedding once, then
  through one block at a time; each block's linears get their Hessians from that block's inputs,
  are quantized, and the *quantized* block's outputs become the next block's inputs. Memory holds
  one block's activations and Hessians, never the whole model's. Embeddings and an untied
  ``lm_head`` use ``rtn``.
- ``awq``: the same block-by-block walk; each group of linears sharing an input gets
  activation-aware scales folded into the norm or linear producing that input, then
  importance-weighted ``rtn`` (:mod:`mlxspec.quant.awq`).
"""

from __future__ import annotations

import hashlib
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxspec.errors import QuantizationError
from mlxspec.quant import awq, format, gptq, rtn
from mlxspec.quant.layers import replace_modules, zero_point_like
from mlxspec.quant.mixed import LayerSpec, load_recipe, plan_layers, quantizable_layers
from mlxspec.quant.storage import (
    ZP_FORMAT,
    cast_floats,
    model_dtype,
    save_quantized,  # noqa: F401  (the saver, re-exported)
)

METHODS = ("rtn", "gptq", "awq")
CALIBRATED = ("gptq", "awq")  # the methods that run calibration text through the model
DEFAULT_CALIBRATION_WINDOWS = 32
DEFAULT_CALIBRATION_TOKENS = 256  # tokens per calibration window
CALIBRATION_BATCH = 4  # windows run through a block at a time


# -- calibration text ----------------------------------------------------------------------------


def builtin_calibration_path() -> Path:
    """The calibration text shipped with the package (``mlxspec/data/calibration.txt``, see
    ``data/PROVENANCE.md``; disjoint from the evaluation text)."""
    return Path(str(resources.files("mlxspec") / "data" / "calibration.txt"))


def calibration_windows(
    tokenizer,
    path: str | Path | None = None,
    *,
    windows: int = DEFAULT_CALIBRATION_WINDOWS,
    window_tokens: int = DEFAULT_CALIBRATION_TOKENS,
) -> tuple[list[list[int]], str]:
    """Consecutive token windows of a calibration text and the text's sha256.

    Args:
        tokenizer: has ``encode(text, add_special_tokens=False)``.
        path: a UTF-8 text file; None for the built-in calibration text.
        windows: at most this many windows (fewer if the text is shorter).
        window_tokens: tokens per window.

    Returns:
        ``(windows, sha256 hex of the file's bytes)``.
    """
    path = Path(path) if path is not None else builtin_calibration_path()
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


# -- quantizing ----------------------------------------------------------------------------------


def _rtn_layer(module: nn.Module, spec: LayerSpec, grid: int, dtype: mx.Dtype) -> nn.Module:
    q, scales, zeros = rtn.quantize(
        np.array(module.weight.astype(mx.float32)), spec.bits, spec.group_size, grid=grid,
        dtype=format.dtype_name(dtype),
    )
    return zero_point_like(module, q, scales, zeros, bits=spec.bits, group_size=spec.group_size,
                           dtype=dtype)


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


def _block_calls(model: nn.Module, tokens: mx.array) -> tuple[mx.array, list]:
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
        self.seen: dict[int, tuple[mx.array, gptq.Hessian]] = {}
        self.produced: dict[int, tuple[mx.array, str]] = {}  # a norm's output -> the norm's name

    def clear(self) -> None:
        self.seen.clear()
        self.produced.clear()


class _HessianRecorder(nn.Module):
    """Wraps a linear layer; adds each input to the layer's (possibly shared) Hessian and notes
    the norm (if any) that produced the input."""

    def __init__(self, linear: nn.Module, shared: _SharedInputs):
        super().__init__()
        self.linear = linear
        self.shared = shared
        self.hessian: gptq.Hessian | None = None
        self.source: str | None = None

    def __call__(self, x):
        seen = self.shared.seen.get(id(x))
        if seen is not None and seen[0] is x:
            self.hessian = seen[1]
        else:
            self.hessian = self.hessian or gptq.Hessian(x.shape[-1])
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


def _record_block(block, targets, hidden, args, kwargs, track_norms: bool
                  ) -> dict[str, _HessianRecorder]:
    """Run ``hidden`` through ``block`` and return a Hessian recorder per target linear (which
    also names the norm that produced its input, with ``track_norms``)."""
    shared = _SharedInputs()
    recorders = {name: _HessianRecorder(m, shared) for name, m in targets.items()}
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


def _gptq_block(block, prefix, targets, recorders, plan, *, act_order, damp, grid, dtype, **_):
    quantized = {}
    for name, module in targets.items():
        spec = plan[f"{prefix}.{name}"]
        q, scales, zeros, perm = gptq.quantize(
            np.array(module.weight.astype(mx.float32)), recorders[name].hessian.matrix(),
            spec.bits, spec.group_size, damp=damp, act_order=act_order, grid=grid,
            dtype=format.dtype_name(dtype),
        )
        quantized[name] = zero_point_like(module, q, scales, zeros, bits=spec.bits,
                                          group_size=spec.group_size, perm=perm, dtype=dtype)
    return quantized


def _awq_block(block, prefix, targets, recorders, plan, *, check, grid, dtype, **_):
    """Search and fold AWQ scales for each group of linears sharing an input, then quantize
    with importance-weighted RTN (see :mod:`mlxspec.quant.awq`)."""
    modules = dict(block.named_modules())
    groups: dict[int, list[str]] = {}
    for name in targets:
        groups.setdefault(id(recorders[name].hessian), []).append(name)
    x, args, kwargs = check
    before = block(x, *args, **kwargs)
    importance = {}  # each target's input energy per column, after the input is divided by s
    for names in groups.values():
        h = recorders[names[0]].hessian.matrix()
        source, fold = recorders[names[0]].source, None
        if source is not None:
            fold = partial(awq.fold_into_norm, modules[source])
        elif len(names) == 1 and names[0].endswith("down_proj"):
            up = modules.get(names[0][: -len("down_proj")] + "up_proj")
            fold = None if up is None else partial(awq.fold_into_rows, up)
        importance.update({n: np.diag(h) for n in names})  # divided by s**2 if scaled below
        if fold is None:
            continue
        specs = [plan[f"{prefix}.{n}"] for n in names]
        weights = [np.array(targets[n].weight.astype(mx.float32)) for n in names]
        bits, group_size = min(sp.bits for sp in specs), max(sp.group_size for sp in specs)
        s, _, _ = awq.search_scales(weights, h, bits, group_size, format.dtype_name(dtype))
        if not awq.scaling_helps(weights, h, s, bits, group_size, grid, format.dtype_name(dtype)):
            continue
        fold(s)
        for n in names:
            awq.scale_columns(targets[n], s)
            importance[n] = importance[n] / s.astype(np.float64) ** 2
    after = block(x, *args, **kwargs)
    drift = (mx.linalg.norm((after - before).astype(mx.float32))
             / mx.linalg.norm(before.astype(mx.float32))).item()
    if not drift < 1e-2:
        raise QuantizationError(
            f"AWQ scaling changed the float outputs of {prefix} (relative {drift:.2g}): this "
            "architecture is not supported by --method awq; use --method gptq"
        )
    quantized = {}
    for name, module in targets.items():
        spec, w = plan[f"{prefix}.{name}"], np.array(module.weight.astype(mx.float32))
        q, scales, zeros = rtn.quantize(w, spec.bits, spec.group_size, grid=grid,
                                        importance=importance[name].astype(np.float32),
                                        dtype=format.dtype_name(dtype))
        quantized[name] = zero_point_like(module, q, scales, zeros, bits=spec.bits,
                                          group_size=spec.group_size, dtype=dtype)
    return quantized


def _calibrated_blocks(model, plan, calibration: mx.array, quantize_block, *, advance, **options):
    """Quantize every planned linear inside the decoder blocks, block by block, with
    ``quantize_block`` (:func:`_gptq_block` or :func:`_awq_block`) given each linear's Hessian."""
    if not isinstance(getattr(model, "layers", None), list):
        raise QuantizationError("calibrated methods need an mlx-lm model with decoder blocks "
                                "(model.layers): use --method rtn")
    paths = {id(m): p for p, m in model.named_modules()}
    chunks = [calibration[i : i + CALIBRATION_BATCH]
              for i in range(0, calibration.shape[0], CALIBRATION_BATCH)]
    hidden, calls = [], None
    for chunk in chunks:
        x, chunk_calls = _block_calls(model, chunk)
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
        recorders = _record_block(block, targets, hidden, args, kwargs,
                                  track_norms=quantize_block is _awq_block)
        quantized = quantize_block(block, prefix, targets, recorders, plan,
                                   check=(hidden[0], args, kwargs), **options)
        replace_modules(block, quantized)
        for name in quantized:
            done.add(f"{prefix}.{name}")
            advance()
        hidden = [block(x, *args, **kwargs) for x in hidden]
        mx.eval(hidden)
    return done


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
    grid: int = rtn.DEFAULT_GRID,
    dtype: str | mx.Dtype | None = None,
    progress: bool = False,
) -> tuple[nn.Module, dict[str, Any]]:
    """Quantize ``model`` in place into zero-point layers.

    Args:
        model: an unquantized mlx-lm model.
        bits, group_size: defaults for every layer (see :mod:`mlxspec.quant.format`).
        method: ``"rtn"``, ``"gptq"`` or ``"awq"``.
        calibration_tokens: for ``gptq`` and ``awq``: token windows, ``(n, T)`` ints (list of lists or mx).
        recipe: a recipe dict, or a name/path for :func:`load_recipe`.
        act_order: GPTQ visits columns by decreasing activation (stored with ``perm``; zp only).
        group_fallback: layers whose input size ``group_size`` does not divide use the largest
            supported group size that does, instead of an error.
        grid: clipping ratios tried per group (1 = min-max).
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``: the dtype of the scales and of
            every unquantized parameter (so of activations and KV cache); default the model's.
            Scales are chosen exact in it (:mod:`mlxspec.quant.format`), so
            :func:`mlxspec.quant.storage.save_quantized` can write MLX's affine layout exactly.
        progress: show a rich progress bar (one step per layer).

    Returns:
        ``(model, quantization)``: the same model object, and the ``quantization`` entry for
        ``config.json`` (``format``, ``method``, ``bits``, ``group_size``, per-layer exceptions in
        ``layers``, ``bits_per_weight``, ...).
    """
    if method not in METHODS:
        raise QuantizationError(f"unknown method {method!r}: choose {', '.join(METHODS)}")
    if isinstance(recipe, (str, Path)):
        recipe = load_recipe(recipe)
    format.check_spec(bits, group_size, group_size)
    dtype = getattr(mx, format.dtype_name(dtype if dtype is not None else model_dtype(model)))
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
    with _progress(len(todo), progress, f"quantizing ({method}, {bits}-bit)") as advance:
        done = set()
        if calibration is not None:
            block_method = _gptq_block if method == "gptq" else _awq_block
            done = _calibrated_blocks(model, plan, calibration, block_method, advance=advance,
                                      act_order=act_order, damp=damp, grid=grid, dtype=dtype)
        for path in todo:
            if path not in done:
                replace_modules(model, {path: _rtn_layer(layers[path], plan[path], grid, dtype)})
                advance()
    cast_floats(model, dtype)
    mx.eval(model.parameters())
    quantization = {
        "format": ZP_FORMAT,  # in memory; save_quantized records the format it writes
        "method": method,
        "dtype": format.dtype_name(dtype),
        "bits": bits,
        "group_size": group_size,
        "act_order": bool(act_order and method == "gptq"),
        "recipe": (recipe or {}).get("name"),
        "layers": {
            path: None if spec is None else {"bits": spec.bits, "group_size": spec.group_size}
            for path, spec in plan.items()
            if spec != LayerSpec(bits, group_size)
        },
        "bits_per_weight": round(bits_per_weight(model), 4),
    }
    from mlxspec import __version__

    quantization["mlxspec_version"] = __version__
    return model, quantization


class _progress:
    """A rich progress bar over ``total`` layers; yields an ``advance()`` callable."""

    def __init__(self, total: int, show: bool, description: str):
        self.total, self.show, self.description = total, show, description

    def __enter__(self):
        if not self.show:
            return lambda: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self.bar = Progress("[progress.description]{task.description}", BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(), transient=False)
        self.bar.start()
        task = self.bar.add_task(self.description, total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc):
        if self.show:
            self.bar.stop()


def bits_per_weight(model: nn.Module) -> float:
    """Stored bits per model weight: all parameter bytes * 8 / number of weights (as mlx-lm's
    ``compute_bits_per_weight``: norms and biases included, a quantized weight counted once)."""
    from mlx_lm.utils import compute_bits_per_weight

    return float(compute_bits_per_weight(model))
