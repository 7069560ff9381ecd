"""Attention, the greedy argmax, RoPE's rotation, RMSNorm, exp and logsumexp on a CPU-only MLX
as single ops: the same bits as MLX's own.

MLX has no CPU attention kernel: ``mx.fast.scaled_dot_product_attention`` composes it from ops
(q scaled, a BLAS product per row and query head for q k^T, the mask, a softmax, a product per row
and head for p v), and its softmax runs MLX's ``exp`` one value at a time through libm's
``fmaf`` (the Linux wheel targets baseline x86-64). Over 8 rows of SmolLM2 (30 layers, 9 heads,
~100 positions) that is ~9 ms of a ~63 ms decode step, and it grows with every row.

``_ops.cpp`` holds six MLX primitives. The attention makes the same BLAS calls on the same
operands (a KV head's query heads in one call where mlxspec's BLAS shim computes each output
alone: the same bits), applies the mask as MLX does and runs MLX's softmax in MLX's order with
MLX's ``exp`` inlined and vectorized. ``greedy_candidates`` is
:func:`mlxspec.serving.rows.greedy_candidates` (argmax and near-tie count per row) in one pass
instead of three scalar ones. ``rope`` is RoPE's rotation from the cosine and sine tables
:mod:`mlxspec.cpu.fused_ops` builds once per position: one op where MLX's rotation is five
(two slices, two products, a concatenation). ``rms_norm`` is MLX's RMSNorm fallback in one op
where the compiled graph is three (square, sum, the rest). ``exp`` and ``logsumexp`` run MLX's
own exp vectorized: its Linux build takes ~13 ns an element through a software fma, 0.65 ms a
49,152-token row, paid by every log-softmax of decoding and every probability of sampled
speculation (4 such rows: 2.68 -> 0.44 ms and 2.57 -> 0.27 ms). ``enable()`` also puts the
dispatcher in ``mx.logsumexp``'s place (mlx-lm's decoding calls it every token); ``exp`` is
reached through ``mlxspec.cpu.exp``. All outputs are bitwise MLX's
(``tests/cpu/test_cpu_ops.py``, ``test_cpu_rope.py``, ``test_cpu_norm.py``,
``test_cpu_exp.py``; each is checked again each time the module loads, else nothing is used).
Measured in ``bench/cpu_ops.py`` (``bench/results/cpu_ops.json``).

``enable()`` builds the module once per MLX/nanobind/Python version (:mod:`mlxspec.cpu.build`),
loads it and puts a dispatcher in ``mx.fast``'s place: float32 inputs with no sinks and no
explicit stream take the primitive, everything else MLX's own function. ``mlxspec.load`` enables
it. Process-wide, like :mod:`mlxspec.cpu.fused_ops`; ``MLXSPEC_CPU_OPS=0`` keeps MLX's own; where
Metal is available nothing changes (MLX has real kernels there). Gradients through the
attention go through MLX's own composition.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from mlxspec.cpu import build
from mlxspec.switches import turned_off

SOURCE = Path(__file__).with_name("_ops.cpp")
MODULE_NAME = "_mlxspec_cpu_ops"  # NB_MODULE's name in SOURCE
SWITCH = "MLXSPEC_CPU_OPS"
EXTENSION = build.Extension(SOURCE, MODULE_NAME, wanted=lambda: not turned_off(SWITCH))

_state: dict[str, object] = {}  # "module", "reference" (MLX's function) while enabled; "why" if not


def enable() -> bool:
    """Build (once), load and check the module, and dispatch ``mx.fast``'s attention to it.

    Idempotent. Returns whether it is in place: not where Metal is available, nor with
    ``MLXSPEC_CPU_OPS=0``, nor where it cannot be built (no ``g++``, no nanobind) or its
    output differs from MLX's in the check; ``describe()`` says which.
    """
    if "module" in _state:
        return True
    if turned_off(SWITCH) or mx.metal.is_available():
        return False
    try:
        module = build.load(build.library(EXTENSION), MODULE_NAME)
        _check(module)
    except build.Unavailable as e:
        _state["why"] = str(e)
        return False
    _state.update(module=module, reference=mx.fast.scaled_dot_product_attention,
                  logsumexp=mx.logsumexp)
    mx.fast.scaled_dot_product_attention = scaled_dot_product_attention
    mx.logsumexp = logsumexp
    return True


def disable() -> None:
    """Put MLX's own function back (benchmarks and tests compare the two)."""
    if "module" in _state:
        mx.fast.scaled_dot_product_attention = _state.pop("reference")
        mx.logsumexp = _state.pop("logsumexp")
        _state.pop("module")


def enabled() -> bool:
    return "module" in _state


def describe() -> str:
    """What ``mlxspec.load`` does with attention and the greedy argmax here (``mlxspec doctor``)."""
    if mx.metal.is_available():
        return "MLX's own (Metal kernel)"
    if enabled():
        return (f"single ops ({SOURCE.name}), bitwise MLX's own compositions; "
                f"{SWITCH}=0 turns them off")
    if turned_off(SWITCH):
        return f"MLX's own compositions ({SWITCH}=0)"
    if "why" in _state:
        return f"MLX's own compositions ({_state['why']})"
    return f"single ops ({SOURCE.name}) once mlxspec.load builds them (g++, nanobind)"


def scaled_dot_product_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                                 mask: None | str | mx.array = None, sinks: mx.array | None = None,
                                 stream=None, **options) -> mx.array:
    """``mx.fast.scaled_dot_product_attention``: the primitive where it applies, else MLX's own.

    q (B, H, Lq, D), k and v (B, KV, L, D) with H a multiple of KV; mask None, ``"causal"`` or
    a bool/float32 array broadcastable to (B, H, Lq, L). Returns (B, H, Lq, D).
    """
    module = _state.get("module")
    if module is not None and sinks is None and stream is None and not options:
        causal = isinstance(mask, str) and mask == "causal"
        array_mask = mask if isinstance(mask, mx.array) else None
        if (causal or mask is None or array_mask is not None) and _supported(q, k, v, array_mask):
            return module.attention(q, k, v, float(scale), array_mask, causal)
    reference: Callable = _state.get("reference", mx.fast.scaled_dot_product_attention)
    return reference(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream, **options)


def greedy_candidates(logits: mx.array, tie: float) -> tuple[mx.array, mx.array] | None:
    """Lazily, for logits (rows, vocabulary) float32: each row's argmax (uint32) and how many of
    its values are >= its largest minus ``tie`` (int32; 0 where the largest is not finite), as
    :func:`mlxspec.serving.rows.greedy_candidates` computes them; None when not enabled."""
    module = _state.get("module")
    if module is None or logits.ndim != 2 or logits.dtype != mx.float32 or 0 in logits.shape:
        return None
    return tuple(module.greedy_candidates(logits, float(tie)))


def argmax(x: mx.array) -> mx.array:
    """``mx.argmax(x, axis=-1)`` (uint32), for float32 by the greedy-candidates primitive (16 lanes
    at a time, MLX's answer: the first NaN, else the first largest): MLX's own scans a
    49,152-token row one value at a time, ~0.3 ms."""
    module = _state.get("module")
    if module is None or x.dtype != mx.float32 or x.ndim < 1 or x.size == 0:
        return mx.argmax(x, axis=-1)
    top, _ = module.greedy_candidates(x.reshape(-1, x.shape[-1]), 0.0)
    return top.reshape(x.shape[:-1])


def logsumexp(a: mx.array, axis: int | list[int] | None = None, keepdims: bool = False, *,
              stream=None) -> mx.array:
    """``mx.logsumexp``: the primitive for float32 over the last axis (a log-softmax's; also
    every axis of a single row, as mlx-lm's decoding asks), else MLX's own. Bitwise MLX's."""
    module = _state.get("module")
    row = a.ndim >= 1 and all(d == 1 for d in a.shape[:-1])
    last = axis in (-1, [-1], (-1,)) or (a.ndim and axis in (a.ndim - 1, [a.ndim - 1]))
    if (module is not None and stream is None and (last or (axis is None and row))
            and a.dtype == mx.float32 and a.size):
        if axis is None:  # all of a, flattened: a shapeless mx.compile may replay this on more rows
            out = module.logsumexp(a if a.ndim == 1 else mx.flatten(a))  # (1,)
            return out.reshape((1,) * a.ndim if keepdims else ())
        out = module.logsumexp(a)
        return out if keepdims else out.squeeze(-1)
    reference: Callable = _state.get("logsumexp", mx.logsumexp)
    return reference(a, axis=axis, keepdims=keepdims, stream=stream)


def exp(x: mx.array) -> mx.array:
    """``mx.exp(x)``, as the primitive for float32 (vectorized, the same bits)."""
    module = _state.get("module")
    if module is not None and x.dtype == mx.float32 and x.ndim >= 1:
        return module.exp(x)
    return mx.exp(x)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array | None:
    """Lazily, ``mx.fast.rms_norm`` of float32 x (..., n) and weight (n,) as one op, bitwise MLX's
    fallback; None when not enabled or for other dtypes (:mod:`mlxspec.cpu.fused_ops` then runs
    its compiled graph)."""
    module = _state.get("module")
    if (module is None or x.dtype != mx.float32 or weight.dtype != mx.float32 or x.ndim < 1
            or weight.ndim != 1 or weight.shape[0] != x.shape[-1] or x.size == 0):
        return None
    return module.rms_norm(x, weight, float(eps))


def rope_rotation(x: mx.array, cos: mx.array, sin: mx.array, dims: int,
                  traditional: bool) -> mx.array | None:
    """Lazily, RoPE's rotation of x (B, N, T, D) float32 by the tables cos, sin (T, dims / 2)
    float32 as one op, bitwise MLX's fallback from those tables; None when not enabled or for
    other shapes and dtypes (:mod:`mlxspec.cpu.fused_ops` then rotates with MLX's ops)."""
    module = _state.get("module")
    if (module is None or x.ndim != 4 or x.dtype != mx.float32 or cos.dtype != mx.float32
            or cos.shape != (x.shape[2], dims // 2) or sin.shape != cos.shape):
        return None
    return module.rope(x, cos, sin, dims, traditional)


def _supported(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> bool:
    """Inputs the primitive takes: anything else (and every error case) goes to MLX's own."""
    if not (q.ndim == k.ndim == v.ndim == 4 and q.dtype == k.dtype == v.dtype == mx.float32):
        return False
    batch, heads, q_len, dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != dim or heads % k.shape[1]:
        return False
    if mask is None:
        return True
    if mask.dtype not in (mx.bool_, mx.float32) or mask.ndim > 4:
        return False
    target = (batch, heads, q_len, k.shape[2])
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    return all(m in (1, t) for m, t in zip(shape, target, strict=True))


def _check(module: ModuleType) -> None:
    """The primitive against MLX's own on a small GQA case with a bool mask and a causal one:
    bitwise, or it stays off (another MLX version, another BLAS order, another SIMD width)."""
    keys = mx.random.split(mx.random.key(0), 3)
    q, k, v = (mx.random.normal(shape, key=key) for shape, key in
               zip([(2, 4, 3, 16), (2, 2, 21, 16), (2, 2, 21, 16)], keys, strict=True))
    mask = mx.arange(21)[None, None, None, :] >= mx.array([0, 5])[:, None, None, None]
    reference = mx.fast.scaled_dot_product_attention
    try:
        for mask_arg, array_mask, causal in ((mask, mask, False), ("causal", None, True)):
            expected = reference(q, k, v, scale=0.25, mask=mask_arg)
            got = module.attention(q, k, v, 0.25, array_mask, causal)
            if not mx.array_equal(expected, got).item():
                raise build.Unavailable("its output differs from MLX's own here")
        rows = mx.concatenate([30 * mx.random.normal((3, 1000), key=keys[1]),
                               mx.array([[-mx.inf] * 999 + [0.0]])])
        for ours, theirs in ((module.logsumexp(rows), mx.logsumexp(rows, -1, keepdims=True)),
                             (module.exp(rows), mx.exp(rows))):
            if not mx.array_equal(ours, theirs, equal_nan=True).item():
                raise build.Unavailable("its exp differs from MLX's own here")
        h, w = mx.random.normal((3, 2, 576), key=keys[2]), mx.random.normal((576,), key=keys[1])
        for rows in (h, h.transpose(1, 0, 2)):
            expected = mx.fast.rms_norm(rows, w, 1e-5)
            if not mx.array_equal(module.rms_norm(rows, w, 1e-5), expected).item():
                raise build.Unavailable("its RMSNorm differs from MLX's own here")
        x = mx.random.normal((2, 3, 5, 16), key=keys[0]).transpose(0, 2, 1, 3)  # (2, 5, 3, 16)
        for traditional in (False, True):
            cos, sin = (mx.random.normal((3, 6), key=key) for key in keys[1:])
            got = module.rope(x, cos, sin, 12, traditional)
            if not mx.array_equal(got, rotation(x, cos, sin, 12, traditional)).item():
                raise build.Unavailable("its RoPE differs from MLX's ops here")
    except (TypeError, RuntimeError, ValueError) as e:  # e.g. another nanobind ABI than MLX's
        raise build.Unavailable(f"calling it failed ({str(e).splitlines()[0]})") from e



def rotation(x: mx.array, cos: mx.array, sin: mx.array, dims: int,
             traditional: bool) -> mx.array:
    """MLX's fallback RoPE from its tables on, op by op: x (B, *, T, D) of any dtype and rank >= 3,
    cos and sin (T, dims / 2) in x's dtype. The primitive's check here, and
    :mod:`mlxspec.cpu.fused_ops`' compiled rotation where the primitive does not apply."""
    shape = x.shape
    if x.ndim == 3:
        x = mx.expand_dims(x, 1)
    elif x.ndim > 4:
        x = mx.flatten(x, 1, x.ndim - 3)
    b, n, t, d = x.shape
    half = dims // 2
    first, second = ((x[..., 0:dims:2], x[..., 1:dims:2]) if traditional
                     else (x[..., :half], x[..., half:dims]))
    rotated = [first * cos - second * sin, first * sin + second * cos]
    if traditional:
        out = mx.concatenate([mx.expand_dims(r, -1) for r in rotated], -1).reshape(b, n, t, dims)
        rotated = [out]
    if dims < d:
        rotated.append(x[..., dims:])
    return mx.concatenate(rotated, -1).reshape(shape)
