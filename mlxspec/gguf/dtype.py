"""The dtype a GGUF import is converted to on this device (issue 45, finding 6).

Matrices and norms alike take it: MLX computes in the widest dtype an op meets, so one float32
norm would put the whole residual stream back in float32. ``MLXSPEC_GGUF_DTYPE`` overrides it.

- A CPU: float32 (MLX's CPU products are float32 BLAS; half types only cost conversions).
- Metal, llama family (the default model): float16. The imported blocks' scales are the GGUF's
  own float16 numbers, and ``mx.quantized_matmul`` computes in the common type of x and the
  scales: float16 activations keep them exact and every product in float16 (half the KV-cache
  bytes of float32, the GPU's fast path), while bfloat16 activations would promote each product
  to float32 or need the scales rounded to bfloat16's 8-bit mantissa. Measured on this
  repository's CPU (quality only): SmolLM2-135M in float16 and in bfloat16 gives the same 48
  greedy tokens as float32. ``mlxspec doctor --kernels`` checks it on the Mac (the activations'
  dtype, greedy agreement with float32, and the decode step time of both).
- Metal, gemma3 (and any other architecture): float32. Gemma's residual stream loses its
  precision in float16 (measured on Gemma-3-270M: logits 15.7 off a float64 reference), and
  bfloat16 meets the float16 scales as above.
"""

from __future__ import annotations

import os

import mlx.core as mx

from mlxspec.errors import UnsupportedModelError

DTYPE_ENV = "MLXSPEC_GGUF_DTYPE"  # overrides conversion_dtype: float32, float16 or bfloat16
DTYPES = ("float32", "float16", "bfloat16")
METAL_DTYPES = {"llama": "float16", "gemma3": "float32"}  # GGUF general.architecture -> dtype


def conversion_dtype(arch_name: str = "llama") -> str:
    """The dtype of a GGUF import of ``arch_name`` (GGUF ``general.architecture``) here: the
    override, else float32 on a CPU and :data:`METAL_DTYPES` on Metal (module docstring)."""
    value = os.environ.get(DTYPE_ENV, "").strip().lower()
    if value:
        if value not in DTYPES:
            raise UnsupportedModelError(
                f"{DTYPE_ENV}={value!r}: choose float32, float16 or bfloat16")
        return value
    if not mx.metal.is_available():
        return "float32"
    return METAL_DTYPES.get(arch_name, "float32")
