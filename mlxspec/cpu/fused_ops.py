"""MLX's fast RoPE and RMSNorm on a CPU-only build, fused: the same bits from far fewer ops.

Where MLX has no Metal back-end, ``mx.fast.rope`` and ``mx.fast.rms_norm`` are not kernels: each
call builds MLX's reference graph for it (RoPE: two aranges, an exp, a cos, a sin, four products,
slices and a concatenate, ~25 ops; RMSNorm ~7), and the CPU back-end pays a fixed cost to
schedule every op whatever its size (~5-10 us on a 2-vCPU x86 host, most of it waking the
stream's thread). SmolLM2-135M's one-token decode step is 4,067 ops, 1,900 of them from its 60
RoPE calls and 61 norms; beyond the weight products, the step's time is mostly that scheduling.

``enable()`` puts compiled versions in their place: each wraps MLX's own function in
``mx.compile``, so the same reference graph is traced once per input shape and its elementwise
chains run as one JIT-compiled kernel each (the decode step: 2,559 ops). A cached forward's
RoPE calls at one position (2 a layer) share their cosine and sine tables, built once by MLX's
own function, so each further call is only its rotation (one op: :mod:`mlxspec.cpu.ops`, which
also runs float32 RMSNorm as one op). The kernels compute the same float
operations in the same order, so the outputs are bitwise those of the reference graph
(``tests/cpu/test_fused_ops.py`` compares them over shapes, dtypes, offsets and a real model's
decoding). Measured in ``bench/fused_ops.py`` (``bench/results/fused_ops.json``: a one-token
step 50.0 -> 41.0 ms).

The first run on a machine pays for the kernels once: MLX's JIT builds each with ``g++`` (~0.5 s
apiece, ~4 s for SmolLM2's ten) into its cache in the temp directory, where later processes find
them; without ``g++`` nothing is fused.

Only inputs of at most ``MAX_FUSED_TOKENS`` positions take the compiled path (decode steps,
batched or not, speculative verification, short prefill chunks): a long prefill's ops are big
enough that scheduling them does not matter, and every new shape costs a trace.

Like the BLAS set-up (:mod:`mlxspec.cpu.blas`) this is process-wide: it changes how MLX computes in
this process, never what. ``mlxspec.load`` enables it; ``MLXSPEC_FUSED_OPS=0`` keeps MLX's own
functions; where Metal is available nothing changes (those functions are real kernels there).
"""

from __future__ import annotations

import functools
import shutil
import threading
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from mlxspec.cpu import jit, ops
from mlxspec.switches import turned_off

SWITCH = jit.FUSED_OPS_SWITCH  # =0: MLX's own functions (and no JIT build: mlxspec.cpu.jit)
# Token positions (the second-to-last axis) up to which an input takes the compiled path.
MAX_FUSED_TOKENS = 64

_reference: dict[str, Callable] = {}  # MLX's own functions while the compiled ones are in place


def _jit_available() -> bool:
    """MLX compiles CPU kernels with ``g++`` (without it ``mx.compile`` changes nothing)."""
    return shutil.which("g++") is not None


def enable() -> bool:
    """Put the compiled RoPE and RMSNorm in ``mx.fast`` where MLX runs them as op graphs.

    Idempotent. Returns whether the compiled versions are in place: not where Metal is
    available, nor with ``MLXSPEC_FUSED_OPS=0``.
    """
    if _reference:
        return True
    if turned_off(SWITCH) or mx.metal.is_available() or not _jit_available():
        return False
    _reference.update(rope=mx.fast.rope, rms_norm=mx.fast.rms_norm)
    mx.fast.rope, mx.fast.rms_norm = rope, rms_norm
    return True


def disable() -> None:
    """Put MLX's own functions back (benchmarks and tests compare the two)."""
    if _reference:
        mx.fast.rope, mx.fast.rms_norm = _reference.pop("rope"), _reference.pop("rms_norm")


def enabled() -> bool:
    """Whether the compiled versions are in place."""
    return bool(_reference)


def describe() -> str:
    """What ``mlxspec.load`` does with RoPE and RMSNorm in this process (for ``mlxspec doctor``)."""
    if mx.metal.is_available():
        return "MLX's own (Metal kernels)"
    if turned_off(SWITCH) and not _reference:
        return "MLX's own op graphs (MLXSPEC_FUSED_OPS=0)"
    if not _jit_available():
        return "MLX's own op graphs (no g++ for MLX's CPU compiler)"
    return (f"compiled (mx.compile) for inputs of at most {MAX_FUSED_TOKENS} positions, "
            "bitwise MLX's own op graphs; MLXSPEC_FUSED_OPS=0 turns it off")


@functools.cache
def _compiled_rope(dims: int, traditional: bool, base: float | None, scale: float,
                   with_freqs: bool) -> Callable:
    reference = _reference["rope"]
    if with_freqs:
        def apply(x: mx.array, offset: mx.array, freqs: mx.array) -> mx.array:
            return reference(x, dims, traditional=traditional, base=None, scale=scale,
                             offset=offset, freqs=freqs)
    else:
        def apply(x: mx.array, offset: mx.array) -> mx.array:
            return reference(x, dims, traditional=traditional, base=base, scale=scale,
                             offset=offset)
    return mx.compile(apply)


def _tables(offset: int, tokens: int, dims: int, traditional: bool, base: float | None,
            scale: float, freqs: mx.array | None, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """MLX's cosine and sine tables (tokens, dims / 2) for positions offset .. offset + tokens - 1.

    MLX's own RoPE applied to rows holding 1 where it reads its first operand and 0 where it reads
    the second returns ``1 * cos - 0 * sin`` and ``1 * sin + 0 * cos``: the tables themselves,
    exactly, whatever the base, scale or frequencies (no constant of MLX's re-derived here).
    """
    unit = np.zeros(dims, np.float32)
    unit[slice(0, None, 2) if traditional else slice(0, dims // 2)] = 1
    rows = mx.array(np.broadcast_to(unit, (1, 1, tokens, dims)).copy())
    compiled = _compiled_rope(dims, traditional, base, scale, freqs is not None)
    at = mx.array(offset, dtype=mx.int32)
    out = (compiled(rows, at) if freqs is None else compiled(rows, at, freqs))[0, 0]
    if traditional:
        cos, sin = out[:, 0::2], out[:, 1::2]
    else:
        cos, sin = out[:, : dims // 2], out[:, dims // 2:]
    return cos.astype(dtype), sin.astype(dtype)


@functools.cache
def _compiled_rotation(dims: int, traditional: bool) -> Callable:
    """MLX's fallback RoPE from its tables on (:func:`mlxspec.cpu.ops.rotation`), compiled."""
    return mx.compile(lambda x, cos, sin: ops.rotation(x, cos, sin, dims, traditional))


# A decode step's 2 x layers RoPE calls share one position, so they share the tables: built once
# a step instead of once a call (an arange, an exp, a cos and a sin: ~6 ops saved a call). Keyed
# by the calling thread (MLX graphs are not shared between threads) and a Python int offset > 0
# (a cached forward's position; an offset array differs per layer, and training calls at 0).
# The lock: two threads evicting at once would both pick the oldest entry (KeyError) or iterate
# while the other inserts (RuntimeError).
_TABLES_KEPT = 8
_tables_kept: dict[tuple, tuple[mx.array, mx.array, mx.array | None]] = {}
_tables_lock = threading.Lock()


def _shared_tables(offset: int, tokens: int, dims: int, traditional: bool,
                   base: float | None, scale: float, freqs: mx.array | None,
                   dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    key = (threading.get_ident(), offset, tokens, dims, traditional, base, scale,
           None if freqs is None else id(freqs), dtype)
    with _tables_lock:
        kept = _tables_kept.get(key)
        if kept is not None and (freqs is None or kept[2] is freqs):
            return kept[0], kept[1]
        cos, sin = _tables(offset, tokens, dims, traditional, base, scale, freqs, dtype)
        if len(_tables_kept) >= _TABLES_KEPT:
            _tables_kept.pop(next(iter(_tables_kept)))
        _tables_kept[key] = (cos, sin, freqs)  # freqs kept alive: its id stays its own
        return cos, sin


@functools.cache
def _compiled_rms_norm(eps: float) -> Callable:
    reference = _reference["rms_norm"]
    return mx.compile(lambda x, weight: reference(x, weight, eps))


def rope(a: mx.array, dims: int, *, traditional: bool, base: float | None, scale: float,
         offset: int | mx.array, freqs: mx.array | None = None, stream=None) -> mx.array:
    """``mx.fast.rope``, compiled for inputs of at most ``MAX_FUSED_TOKENS`` positions.

    Same arguments and result: ``a`` (B, *, T, D), ``offset`` an int, a scalar or a (B,) array.
    """
    if _reference and stream is None and a.ndim >= 3 and a.shape[-2] <= MAX_FUSED_TOKENS:
        if isinstance(offset, int) and offset > 0:
            cos, sin = _shared_tables(offset, a.shape[-2], dims, traditional, base, scale,
                                      freqs, a.dtype)
            rotated = ops.rope_rotation(a, cos, sin, dims, traditional)  # one op, where built
            return _compiled_rotation(dims, traditional)(a, cos, sin) if rotated is None else rotated
        if not isinstance(offset, mx.array):  # a Python int would be a constant: one trace each
            offset = mx.array(offset, dtype=mx.int32)
        compiled = _compiled_rope(dims, traditional, base, scale, freqs is not None)
        return compiled(a, offset) if freqs is None else compiled(a, offset, freqs)
    reference = _reference.get("rope", mx.fast.rope)
    return reference(a, dims, traditional=traditional, base=base, scale=scale, offset=offset,
                     freqs=freqs, stream=stream)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float, *, stream=None) -> mx.array:
    """``mx.fast.rms_norm``, compiled for inputs of at most ``MAX_FUSED_TOKENS`` positions."""
    small = x.ndim < 2 or x.shape[-2] <= MAX_FUSED_TOKENS
    if _reference and stream is None and weight is not None and small:
        single = ops.rms_norm(x, weight, eps)  # one op, where built (float32)
        return _compiled_rms_norm(float(eps))(x, weight) if single is None else single
    reference = _reference.get("rms_norm", mx.fast.rms_norm)
    return reference(x, weight, eps, stream=stream)
