"""MLX's CPU backend on Linux: everything mlxspec does only there, behind one seam.

MLX's Linux wheel runs every op on the CPU with a reference BLAS, a per-op JIT built for
baseline x86-64 and no attention kernel. This package makes that backend fast without changing
a single output bit (each module's docstring says how; ``docs/linux-cpu.md`` has the design and
every switch):

    allocator    the ``mlxspec`` command re-executes itself once on mimalloc
    build        compiling and loading the C++ extensions below (once per machine)
    blas         MLX's cblas calls forwarded to OpenBLAS, small products to the shim's kernel
    jit          MLX's JIT kernels built for this CPU (AVX2/FMA/F16C flags)
    fused_ops    RoPE and RMSNorm as compiled kernels
    ops          attention and the greedy argmax as single MLX primitives (``_ops.cpp``)
    quantized    4/8-bit affine products on the packed weights (``_quantized.cpp``)
    layers       a Llama decoder layer as four ops on those products (``_layer.h``)
    huge_pages   weights onto 2 MB pages

The rest of mlxspec calls only the functions below: :func:`start` when ``mlxspec`` is imported
(before ``mlx.core``), :func:`before_load` and :func:`prepare` from ``mlxspec.load``,
:func:`report` from ``mlxspec doctor``, :func:`greedy_candidates` and :func:`blas_report` from
the engine and the benchmarks, :func:`quantized_products`, :func:`packed_weights_pay`, :func:`packed_bits` and
:func:`quantized_matmul` from the quantized layers and the GGUF import. Each is a no-op (or reports "not used") where Metal runs.
``tests/test_structure.py`` checks that no module outside this package imports its internals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn


def start() -> None:
    """Process start, before ``mlx.core`` is imported (``import mlxspec`` calls it): the
    ``mlxspec`` command starts over once on mimalloc, and MLX's BLAS is bound to OpenBLAS.
    Standard library only, so ``import mlxspec`` stays cheap."""
    from mlxspec.cpu import allocator, blas

    if allocator.launched_as_command():
        allocator.reexec_on_mimalloc()
    blas.setup()


def before_load() -> None:
    """Before any model is built or converted: MLX's JIT kernels get this CPU's flags (a kernel
    built earlier in the process would keep MLX's baseline build)."""
    from mlxspec.cpu import jit

    jit.enable()


def prepare(model: nn.Module | None, *, lazy: bool = False) -> None:
    """After ``model`` is built: compiled RoPE/RMSNorm and the attention primitive enabled
    (process-wide, the same bits), the model's MLX quantized layers given the packed-weight
    kernel and its Llama layers four ops each, the weights moved onto 2 MB pages in the
    background (not for a ``lazy`` model, whose weights are not there yet), and the BLAS threads
    sized again past the start-up's own load."""
    from mlxspec.cpu import blas, fused_ops, huge_pages, layers, ops, quantized

    fused_ops.enable()
    ops.enable()
    if model is not None:
        quantized.install(model)
        layers.install(model)
    if model is not None and not lazy:
        huge_pages.back_weights(model)
    blas.refresh_threads()


def report(measure: bool = True) -> dict[str, Any]:
    """What the CPU backend does in this process, one entry per part (``mlxspec doctor``);
    ``measure`` times a BLAS product for its GFLOP/s."""
    from mlxspec.cpu import allocator, blas_info, fused_ops, huge_pages, jit, layers, ops, quantized

    return {
        "blas": blas_info.blas_report(measure=measure),
        "fused_ops": fused_ops.describe(),
        "cpu_jit": jit.describe(),
        "cpu_ops": ops.describe(),
        "quantized_products": quantized.describe(),
        "llama_layers": layers.describe(),
        "huge_pages": huge_pages.describe(),
        "allocator": allocator.describe(),
    }


def blas_report(measure: bool = False) -> dict[str, Any]:
    """The BLAS in use (benchmarks record it beside their numbers)."""
    from mlxspec.cpu import blas_info

    return blas_info.blas_report(measure=measure)


def deadline(seconds: float, message: str | None = None) -> bool:
    """End the process ``seconds`` from now with ``message`` (one line) on stderr and exit status
    2, unless called again first (``seconds <= 0`` disarms), from a C thread: it fires even while
    the Python thread is stuck in a call holding the GIL. False where that thread is not
    available (Metal, no BLAS shim): then nothing happens."""
    from mlxspec.cpu import blas

    return blas.deadline(seconds, message)


def cpu_model() -> str:
    """The CPU's name, with its family and model where Linux reports them (see
    :func:`mlxspec.cpu.jit.cpu_model`): benchmark results record it."""
    from mlxspec.cpu.jit import cpu_model as model

    return model()


def greedy_candidates(logits: mx.array, tie: float) -> tuple[mx.array, mx.array] | None:
    """The attention primitive's sibling: argmax and near-tie count per row of ``logits``
    (rows, vocabulary) float32 in one op, or None where the primitive is not enabled."""
    from mlxspec.cpu import ops

    return ops.greedy_candidates(logits, tie)


def argmax(x: mx.array) -> mx.array:
    """``mx.argmax(x, axis=-1)`` lazily (uint32, the same answer); float32 on the CPU backend as
    one vectorized op (MLX's scans a 49,152-token row one value at a time: ~0.3 ms a row)."""
    from mlxspec.cpu import ops

    return ops.argmax(x)


def exp(x: mx.array) -> mx.array:
    """``mx.exp(x)`` lazily; float32 on the CPU backend as one vectorized op with MLX's own bits
    (MLX's Linux build computes exp one element at a time through a software fma: 0.65 ms for a
    49,152-token row of probabilities)."""
    from mlxspec.cpu import ops

    return ops.exp(x)


def quantized_products() -> bool:
    """Whether quantized weights stay packed on this CPU: the kernel of :mod:`mlxspec.cpu.quantized`
    is built and checked (built on the first call, ~20 s once per machine). False where Metal
    runs, with ``MLXSPEC_CPU_QMM=0``, or where it cannot be built."""
    from mlxspec.cpu import quantized

    return quantized.enable()


def packed_weights_pay() -> tuple[bool, dict[str, float]]:
    """Whether quantized weights should stay packed on this CPU rather than become float32 copies
    (GGUF imports): the kernel is built and a decode product on it beat float32 + BLAS here,
    measured once per machine (:func:`mlxspec.cpu.quantized.packed_pays`); with the numbers."""
    from mlxspec.cpu import quantized

    return quantized.packed_pays()


def packed_bits() -> tuple[int, ...]:
    """The bit widths the packed-weight kernel multiplies (4 and 8), or () where it is not
    enabled: MLX's own CPU product of other widths loops over x's rows one scalar mat-vec at a
    time, so such weights pay as float32 copies."""
    from mlxspec.cpu import quantized

    return quantized.BITS if quantized.enable() else ()


def quantized_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array | None, *,
                     group_size: int, bits: int) -> mx.array | None:
    """``x @ W.T`` for x (..., K) float and W (N, K) in MLX's affine layout (``weight`` uint32
    (N, K * bits / 32), ``scales`` and ``biases`` (N, K / group_size) float32/float16/bfloat16)
    on the packed weights: (..., N) in x's dtype, or None where the kernel is not enabled
    (:func:`quantized_products`) or does not take this layout (then use ``mx.quantized_matmul``)."""
    from mlxspec.cpu import quantized

    return quantized.matmul(x, weight, scales, biases, group_size=group_size, bits=bits)
