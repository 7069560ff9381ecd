"""A Llama-family decoder layer as four MLX ops on a CPU-only MLX, with the unfused layer's bits.

MLX's CPU back-end pays a fixed cost to schedule each op (~8 us on a 2-vCPU x86 host), and a
one-token step of SmolLM2-135M is ~30 ops a layer beside its 7 quantized products: a quarter to
a third of the step (``docs/linux-cpu.md``). ``_layer.h`` (built into the quantized kernel's
module, :mod:`mlxspec.cpu.quantized`) computes an ``mlx_lm.models.llama.TransformerBlock`` for
1 to 24 new tokens with a KV cache as four ops: RMSNorm, the q/k/v products on the packed weights
and RoPE (from :mod:`mlxspec.cpu.fused_ops`' tables); the new keys, and the new values, written
into the cache's buffers in place; attention, the o product, the MLP and both residual sums. Each
number is computed as the unfused layer computes it (the same kernels in the same order), so the
output, the cache and the logits are bitwise the unfused ones (``tests/cpu/test_cpu_layers.py``).

:func:`install` swaps the class of each layer that qualifies (its seven projections on the packed
kernel, ``nn.RoPE``, ``nn.RMSNorm``) for :class:`LlamaBlock`, from ``mlxspec.cpu.prepare``. A call
takes the fused path for one sequence (batch 1) of up to 24 new tokens, float32, with mask None or
``"causal"``, on mlx-lm's plain ``KVCache`` whose buffer has room for them; anything else (prefill,
the first step after the cache grows, batches, rotating or quantized caches) runs the layer as
mlx-lm wrote it. With int8 activations (``MLXSPEC_CPU_QMM_ACTIVATIONS=int8``) the products round
x as the unfused products do: the same bits again. ``MLXSPEC_CPU_LAYERS=0`` turns it off.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from mlxspec.cpu import fused_ops, ops, quantized
from mlxspec.switches import turned_off

SWITCH = "MLXSPEC_CPU_LAYERS"
_installed = [0]  # layers given the primitive in this process (doctor's line)


def _projections(layer: llama.TransformerBlock) -> tuple[nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
            mlp.down_proj)


def _packed(proj: nn.Module) -> bool:
    """On the packed kernel with the weight it was checked with, and no bias."""
    return (type(proj) is quantized.QuantizedLinear and "bias" not in proj
            and getattr(proj, "_checked", None) == (id(proj["weight"]), proj["weight"].shape))


def qualifies(layer: nn.Module) -> bool:
    """Whether ``layer`` is a Llama block the primitive computes (its parameters as they are now)."""
    if type(layer) not in (llama.TransformerBlock, LlamaBlock):
        return False
    attn = layer.self_attn
    return (type(attn) is llama.Attention and type(layer.mlp) is llama.MLP
            and type(attn.rope) is nn.RoPE
            and type(layer.input_layernorm) is nn.RMSNorm
            and type(layer.post_attention_layernorm) is nn.RMSNorm
            and all(_packed(p) for p in _projections(layer)))


@functools.lru_cache(maxsize=8)
def _off(value: bytes | str | None) -> bool:
    value = os.fsdecode(value) if isinstance(value, bytes) else value
    return turned_off(SWITCH, {SWITCH: value} if value is not None else {})


# Read at every call (tests and A/B runs change it) through os.environ's own mapping: see
# mlxspec.cpu.quantized, whose switches are read the same way.
_ENVIRON = getattr(os.environ, "_data", None) if os.name == "posix" else None
_KEY = os.fsencode(SWITCH)


def enabled() -> bool:
    """The primitive can run here now: the packed kernel, the attention op and the RoPE tables
    are on, and neither this switch nor the kernel's is off."""
    value = os.environ.get(SWITCH) if _ENVIRON is None else _ENVIRON.get(_KEY)
    if _off(value) or not (quantized.enabled() and ops.enabled() and fused_ops.enabled()):
        return False
    return not quantized._product_switches()[0]


def install(model: nn.Module) -> int:
    """Swap the class of each of ``model``'s qualifying layers for :class:`LlamaBlock`
    (parameters, saving and ``isinstance`` unchanged). Returns how many layers now have it."""
    if not enabled():
        return 0
    count = 0
    for _, module in model.named_modules():
        if type(module) is llama.TransformerBlock and qualifies(module):
            module.__class__ = LlamaBlock
            count += 1
    _installed[0] += count
    return count


def describe() -> str:
    """One line for ``mlxspec doctor``."""
    if turned_off(SWITCH):
        return f"off ({SWITCH}=0)"
    if not enabled():
        return "off (needs the packed-weight kernel, the attention op and the RoPE tables)"
    return (f"Llama layers as 4 ops each ({_installed[0]} installed in this process); "
            f"{SWITCH}=0 turns it off")


def cache_copies() -> int:
    """How many times a layer copied its KV cache's buffer because MLX could not hand it over
    (something else held it): 0 in a plain decode or speculative loop."""
    module = quantized._state.get("module")
    return int(module.layer_cache_copies()) if module is not None else 0


def _fused(layer: llama.TransformerBlock, x: mx.array, mask: object, cache: object) -> mx.array | None:
    module = quantized._state.get("module")
    if not (module is not None and type(cache) is KVCache and x.ndim == 3 and x.shape[0] == 1
            and 1 <= x.shape[1] <= module.max_kernel_rows and x.dtype == mx.float32
            and (mask is None or (isinstance(mask, str) and mask == "causal"))):
        return None
    keys, values, offset, tokens = cache.keys, cache.values, cache.offset, x.shape[1]
    if (keys is None or offset <= 0 or offset + tokens > keys.shape[2] or keys.dtype != mx.float32
            or values.shape != keys.shape or not enabled()):
        return None  # the unfused layer grows the cache (every 256 tokens) or writes the first rows
    projections = _projections(layer)
    if any(type(p) is not quantized.QuantizedLinear for p in projections):
        return None  # replaced since install (a tensor-parallel shard, say)
    weights = [a for p in projections for a in (p["weight"], p["scales"], p["biases"])]
    checked = tuple(map(id, weights))
    if checked != getattr(layer, "_fused_weights", None):  # new weights (load_weights): again
        if not qualifies(layer):
            return None
        object.__setattr__(layer, "_fused_weights", checked)
    attn, rope = layer.self_attn, layer.self_attn.rope
    cos, sin = fused_ops._shared_tables(offset, tokens, rope.dims, rope.traditional, rope.base,
                                        rope.scale, None, mx.float32)
    out, cache.keys, cache.values = module.decode_layer(
        x, layer.input_layernorm.weight, layer.post_attention_layernorm.weight, cos, sin, keys,
        values, weights, attn.n_heads, attn.n_kv_heads, rope.dims, offset, rope.traditional,
        mask is not None, float(attn.scale), float(layer.input_layernorm.eps),
        float(layer.post_attention_layernorm.eps), [p.bits for p in projections],
        [p.group_size for p in projections], quantized.int8_activations())
    cache.offset += tokens
    return out


class LlamaBlock(llama.TransformerBlock):
    """mlx-lm's Llama block whose cached steps of up to 24 tokens run as four ops (see above)."""

    def __call__(self, x: mx.array, mask: object = None, cache: object = None) -> mx.array:
        out = _fused(self, x, mask, cache)
        return super().__call__(x, mask, cache) if out is None else out
