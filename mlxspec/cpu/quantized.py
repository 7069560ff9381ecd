"""Affine-quantized products on a CPU-only MLX read the packed weights: no float32 copies.

MLX's CPU ``quantized_matmul`` redoes a scalar mat-vec for every row of ``x``, slower than a
float32 copy through OpenBLAS; but a float32 copy makes SmolLM2-135M read 538 MB per token instead
of ~98 at 4 bits (``bytes_per_token`` in ``bench/results/decode.json``). ``_quantized.cpp`` holds
one MLX primitive for ``x @ W.T`` on MLX's own affine layout (uint32-packed 4- and 8-bit weights, a
scale and a bias per group of 32, 64 or 128 in float32, float16 or bfloat16): products of up to
``max_kernel_rows`` (24) rows unpack the integers in registers (AVX-512 where the CPU has it, else
AVX2), one output's sum computed the same way whatever the number of rows (the fused prefill of
:mod:`mlxspec.serving.fused_prefill` relies on it); larger products (prefill) dequantize W a tile
at a time into the float32 values a dense copy would hold and multiply them with sgemm. Measured in
``bench/decode.py``.

Where it runs: :func:`matmul` is what ``mlxspec.cpu.quantized_matmul`` calls (zero-point layers of
:mod:`mlxspec.quant.layers`); :func:`install` gives a model's ``nn.QuantizedLinear`` and
``nn.QuantizedEmbedding`` layers the kernel (their class swapped for a subclass: the same
parameters, the same ``isinstance``), from ``mlxspec.cpu.prepare``. Models loaded through
plain mlx-lm are untouched: ``mx.quantized_matmul`` itself is not replaced.

Built once per MLX/nanobind/Python version and ISA into ``$MLXSPEC_HOME/cpu_ops/``
(:func:`mlxspec.cpu.build.library`) and checked against a float64 product when it loads.
``MLXSPEC_CPU_QMM=0`` keeps MLX's own products (and float32 copies where mlxspec made them),
``MLXSPEC_CPU_QMM=avx2`` builds the AVX2 kernel on an AVX-512 CPU (benchmarks). Only where Metal
is unavailable, on a Linux x86-64 CPU with AVX2, FMA and F16C.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import sum_gradients

from mlxspec.cpu import build
from mlxspec.cpu import jit as cpu_jit
from mlxspec.switches import turned_off

SOURCE = Path(__file__).with_name("_quantized.cpp")
MODULE_NAME = "_mlxspec_cpu_quantized"  # NB_MODULE's name in SOURCE
SWITCH = "MLXSPEC_CPU_QMM"
ACTIVATIONS = "MLXSPEC_CPU_QMM_ACTIVATIONS"  # "float32" (default) or "int8" (VNNI CPUs)
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
SCALE_TYPES = (mx.float32, mx.float16, mx.bfloat16)

_state: dict[str, object] = {}  # "module" once loaded and checked; "why" when it cannot be
_lock = threading.Lock()


def _extra_flags() -> tuple[str, ...]:
    flags = cpu_jit.cpuinfo().get("flags", "").split()
    if os.environ.get(SWITCH, "").strip().lower() == "avx2" or not all(f in flags for f in AVX512):
        return ()
    vnni = ("-mavx512vnni",) if "avx512_vnni" in flags else ()
    return (*(f"-m{f}" for f in AVX512), *vnni)


EXTENSION = build.Extension(SOURCE, MODULE_NAME, _extra_flags,
                            wanted=lambda: not turned_off(SWITCH) and cpu_jit._cpu_supported())


def int8_activations() -> bool:
    """Whether products of up to 24 rows round x to int8 per block of 32 and use VNNI dot
    products, as llama.cpp does (``MLXSPEC_CPU_QMM_ACTIVATIONS=int8``, where the CPU has VNNI;
    the default ``float32`` keeps x as it is): faster, as exact as llama.cpp and less than the
    default (``docs/linux-cpu.md``)."""
    module = _state.get("module")
    return module is not None and bool(module.int8_activations) and _product_switches()[1]


@functools.lru_cache(maxsize=32)
def _switches(switch: str | bytes | None, activations: str | bytes | None) -> tuple[bool, bool]:
    """(kernel turned off, int8 activations asked for) from the two variables' values: read at
    every product (tests and A/B runs change them), parsed once per value (a decode token makes
    ~200 products, and the parsing cost more than the kernel call itself)."""
    switch, activations = (os.fsdecode(v) if isinstance(v, bytes) else v
                           for v in (switch, activations))
    off = turned_off(SWITCH, {SWITCH: switch} if switch is not None else {})
    return off, (activations or "float32").strip().lower() == "int8"


# os.environ.get encodes its key and decodes the value at every call (~1.5 us, 0.7 ms of the ~4.4
# ms of Python a decode token spends building its graph); the mapping behind it, which setting and
# deleting variables through os.environ keep current, answers for pre-encoded keys at once.
_ENVIRON = getattr(os.environ, "_data", None) if os.name == "posix" else None  # bytes keys
_KEYS = (os.fsencode(SWITCH), os.fsencode(ACTIVATIONS))


def _product_switches() -> tuple[bool, bool]:
    """``_switches`` of the variables as they are now."""
    if _ENVIRON is None:
        return _switches(os.environ.get(SWITCH), os.environ.get(ACTIVATIONS))
    return _switches(_ENVIRON.get(_KEYS[0]), _ENVIRON.get(_KEYS[1]))


def enable() -> bool:
    """Build (once), load and check the kernel. Idempotent and thread-safe; returns whether it is
    usable here (not on Metal, not with ``MLXSPEC_CPU_QMM=0``, not without g++/nanobind/AVX2)."""
    if turned_off(SWITCH) or mx.metal.is_available():  # read at every call: tests, A/B runs
        return False
    if "module" in _state:
        return True
    if "why" in _state:
        return False
    with _lock:
        if "module" in _state or "why" in _state:
            return "module" in _state
        try:
            if not cpu_jit._cpu_supported():
                raise build.Unavailable("needs a Linux x86-64 CPU with AVX2, FMA and F16C")
            module = build.load(build.library(EXTENSION), MODULE_NAME)
            _check(module)
        except build.Unavailable as e:
            _state["why"] = str(e)
            return False
        _state["module"] = module
    return True


def enabled() -> bool:
    return "module" in _state


def describe() -> str:
    """How quantized products run on this CPU (``mlxspec doctor``)."""
    if mx.metal.is_available():
        return "not used (Metal)"
    if turned_off(SWITCH):
        return f"MLX's own quantized_matmul / float32 copies ({SWITCH}=0)"
    if enabled():
        module = _state["module"]
        acts = ("int8 activations (VNNI)" if int8_activations() else
                f"float32 activations ({ACTIVATIONS}=int8: VNNI, faster, llama.cpp's accuracy)"
                if module.int8_activations else "float32 activations")
        return (f"packed 4/8-bit products ({SOURCE.name}, {module.isa}): up to "
                f"{module.max_kernel_rows} rows in registers with {acts}, more as dequantized "
                f"tiles + sgemm; {SWITCH}=0 turns it off")
    if "why" in _state:
        return f"MLX's own quantized_matmul / float32 copies ({_state['why']})"
    return f"packed 4/8-bit products ({SOURCE.name}) once mlxspec.load builds them (g++, nanobind)"


CHOICE_FILE = "packed_vs_dense.json"  # in $MLXSPEC_HOME/cpu_ops/: the measurement, per machine
CHOICE_SHAPE = (1536, 576)  # (out, in) of the measured product: SmolLM2's MLP, one decode row


def _choice_key() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return f"{cpu_jit.cpu_model()} | {os.cpu_count()} CPUs | {SOURCE.name} {digest}"


def _measure(matrices: int = 32, rounds: int = 3) -> dict[str, float]:
    """Milliseconds of one decode row through ``matrices`` different (1536, 576) weights (more
    bytes than the caches hold, as a model's layers): packed 4-bit on the kernel, and float32
    copies through BLAS. Best of ``rounds``."""
    n, k = CHOICE_SHAPE
    dense = [mx.random.normal((n, k), key=mx.random.key(i)) * 0.05 for i in range(matrices)]
    packed = [mx.quantize(w, group_size=32, bits=4) for w in dense]
    x = mx.random.normal((1, k), key=mx.random.key(matrices))
    mx.eval(dense, packed, x)

    def best(product) -> float:
        times = []
        for _ in range(rounds):
            tic = time.perf_counter()
            for i in range(matrices):
                mx.eval(product(i))
            times.append(time.perf_counter() - tic)
        return 1e3 * min(times) / matrices

    return {"packed_ms": best(lambda i: matmul(x, *packed[i], group_size=32, bits=4)),
            "dense_ms": best(lambda i: x @ dense[i].T)}


def packed_pays() -> tuple[bool, dict[str, float]]:
    """Whether decode products on the packed weights beat float32 copies through BLAS on this
    machine, with the measurement (``packed_ms``, ``dense_ms``: one row through a (1536, 576)
    weight). Measured once per machine and kernel (~1 s) and kept in
    ``$MLXSPEC_HOME/cpu_ops/packed_vs_dense.json``; False without the kernel."""
    if not enable():
        return False, {}
    if "choice" in _state:
        return _state["choice"]
    from mlxspec import paths

    path, key = paths.home() / "cpu_ops" / CHOICE_FILE, _choice_key()
    with _lock, paths.locked_directory(path.parent):
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            saved = {}
        if not isinstance(saved.get(key), dict):
            saved[key] = _measure()
            with contextlib.suppress(OSError):
                path.write_text(json.dumps(saved, indent=2) + "\n")
        measured = saved[key]
        _state["choice"] = (measured["packed_ms"] < measured["dense_ms"], measured)
    return _state["choice"]


def supported(weight: mx.array, scales: mx.array, biases: mx.array | None, group_size: int,
              bits: int, mode: str = "affine") -> bool:
    """Whether the kernel takes a weight of this layout (else MLX's own product is used)."""
    return (mode == "affine" and bits in BITS and group_size in GROUP_SIZES
            and biases is not None and weight.dtype == mx.uint32 and weight.ndim == 2
            and scales.dtype in SCALE_TYPES and biases.dtype in SCALE_TYPES
            and scales.shape == biases.shape
            and scales.shape == (weight.shape[0], weight.shape[1] * 32 // bits // group_size))


def matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array | None, *,
           group_size: int, bits: int, mode: str = "affine") -> mx.array | None:
    """``x @ W.T`` lazily, for ``x`` (..., K) float and W (N, K) in MLX's affine layout (``weight``
    uint32 (N, K * bits / 32), ``scales`` and ``biases`` (N, K / group_size)); returns (..., N) in
    ``x``'s dtype (computed in float32), or None when the kernel is not enabled or does not take
    this layout."""
    module = _state.get("module")
    if (module is None or x.ndim < 1 or x.dtype not in SCALE_TYPES or x.size == 0
            or not supported(weight, scales, biases, group_size, bits, mode)
            or x.shape[-1] != weight.shape[1] * 32 // bits):
        return None
    return _product(module, x, weight, scales, biases, group_size, bits)


def _product(module: ModuleType, x: mx.array, weight: mx.array, scales: mx.array,
             biases: mx.array, group_size: int, bits: int) -> mx.array | None:
    """The kernel's ``x @ W.T`` for a layout already checked (None when switched off)."""
    off, int8 = _product_switches()
    if off:
        return None
    y = module.quantized_matmul(x.astype(mx.float32), weight, scales, biases, group_size, bits,
                                int8 and bool(module.int8_activations))
    return y if x.dtype == mx.float32 else y.astype(x.dtype)


def _layer_product(layer: nn.Module, x: mx.array) -> mx.array | None:
    """A quantized layer's ``x @ W.T`` on the kernel (no bias), or None where it does not run."""
    module, weight = _state.get("module"), layer["weight"]
    # The layout was checked at install; a replaced weight (load_weights) is checked again.
    if (module is not None and x.dtype in SCALE_TYPES and x.size
            and (id(weight), weight.shape) == layer._checked and x.shape[-1] == layer._in_features):
        return _product(module, x, weight, layer["scales"], layer["biases"], layer.group_size,
                        layer.bits)
    return matmul(x, weight, layer["scales"], layer.get("biases"), group_size=layer.group_size,
                  bits=layer.bits, mode=layer.mode)


class QuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose product runs on the kernel where it takes the layout."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _layer_product(self, x)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class QuantizedAllToShardedLinear(nn.QuantizedAllToShardedLinear):
    """MLX's tensor-parallel quantized layer whose output is split over the group (``--shard
    tensor``), its product on the kernel: MLX's own calls ``mx.quantized_matmul``, whose CPU
    path made a sharded default model decode at a fraction of one process's speed."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _layer_product(self, sum_gradients(self.group)(x))
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class QuantizedShardedToAllLinear(nn.QuantizedShardedToAllLinear):
    """MLX's tensor-parallel quantized layer whose input is split over the group and whose
    output is summed over it, its product on the kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _layer_product(self, x)
        if y is None:
            return super().__call__(x)
        y = mx.distributed.all_sum(y, group=self.group)
        return y + self["bias"] if "bias" in self else y


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose tied output head runs on the kernel (lookups unchanged)."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = matmul(x, self["weight"], self["scales"], self.get("biases"),
                   group_size=self.group_size, bits=self.bits, mode=self.mode)
        return super().as_linear(x) if y is None else y


_SWAPS = ((nn.QuantizedLinear, QuantizedLinear), (nn.QuantizedEmbedding, QuantizedEmbedding),
          (nn.QuantizedAllToShardedLinear, QuantizedAllToShardedLinear),
          (nn.QuantizedShardedToAllLinear, QuantizedShardedToAllLinear))


def install(model: nn.Module) -> int:
    """Give ``model``'s MLX quantized layers the kernel (their class only: parameters, saving
    and ``isinstance`` unchanged). Returns how many layers now use it (0 when not enabled)."""
    if not enable():
        return 0
    count = 0
    for _, module in model.named_modules():
        for base, cls in _SWAPS:
            if type(module) is base and supported(module["weight"], module["scales"],
                                                  module.get("biases"), module.group_size,
                                                  module.bits, module.mode):
                module.__class__ = cls
                # plain attributes (not parameters): the weight checked and its input size
                object.__setattr__(module, "_checked", (id(module["weight"]), module["weight"].shape))
                object.__setattr__(module, "_in_features",
                                   module["weight"].shape[1] * 32 // module.bits)
                count += 1
    return count


def reference(x: np.ndarray, weight: np.ndarray, scales: np.ndarray, biases: np.ndarray,
              group_size: int, bits: int) -> np.ndarray:
    """``x @ W.T`` in float64 from MLX's layout (numpy arrays; scales/biases as float): the
    reference the kernel is checked against, here and in the tests."""
    w = weight.astype(np.uint64)
    per_word = 32 // bits
    q = (w[:, :, None] >> (bits * np.arange(per_word, dtype=np.uint64))) & ((1 << bits) - 1)
    q = q.reshape(weight.shape[0], -1).astype(np.float64)
    s = np.repeat(scales.astype(np.float64), group_size, axis=1)
    b = np.repeat(biases.astype(np.float64), group_size, axis=1)
    return x.astype(np.float64) @ (s * q + b).T


def _check(module: ModuleType) -> None:
    """The kernel (1 and 3 rows, both activation types) and the tile path (30 rows) against
    :func:`reference`: within float32 rounding (and int8's rounding of x), or it stays off."""
    rng = np.random.default_rng(0)
    for bits, rows in ((4, 1), (8, 3), (4, 30)):
        w = mx.array(rng.integers(0, 2**32, size=(20, 64 * bits // 32), dtype=np.uint32))
        s = mx.array(rng.uniform(0.01, 0.1, size=(20, 2)).astype(np.float16))
        b = mx.array(rng.uniform(-1, 1, size=(20, 2)).astype(np.float16))
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        expected = reference(x, np.array(w), np.array(s), np.array(b), 32, bits)
        magnitude = reference(np.abs(x), np.array(w), np.array(s), np.abs(np.array(b)), 32, bits)
        for int8 in (False, True) if module.int8_activations else (False,):
            try:
                got = np.array(module.quantized_matmul(mx.array(x), w, s, b, 32, bits, int8))
            except (TypeError, RuntimeError, ValueError) as e:
                raise build.Unavailable(f"calling it failed ({str(e).splitlines()[0]})") from e
            # int8 activations: x moves by up to 1/254 of its block's largest element
            slack = 1e-2 * magnitude if int8 and rows <= module.max_kernel_rows else 0.0
            if not np.all(np.abs(got - expected) <= 1e-4 * np.abs(expected) + 1e-3 + slack):
                raise build.Unavailable("its output differs from a float64 product here")
