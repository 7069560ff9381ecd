"""Import AutoGPTQ and AutoAWQ checkpoints (Hugging Face layout) into the zero-point zp_format.

Both store, per linear layer ``<path>``, int32 tensors ``qweight`` and ``qzeros`` and float16
``scales`` of shape ``(n_groups, out)``, with ``w = scale * (q - z)`` -- the same model as
:mod:`mlxspec.quant.zp_format`, laid out differently:

- AutoGPTQ (``quant_method: gptq``): ``qweight`` ``(in * bits / 32, out)`` packs ``q`` down each
  *column* as a little-endian bit stream (our layout, transposed); ``qzeros``
  ``(n_groups, out * bits / 32)`` packs ``z`` along the output axis the same way. The original
  ``checkpoint_format: gptq`` stores ``z - 1`` (AutoGPTQ adds the 1 back when it dequantizes);
  ``gptq_v2`` stores ``z``. With act-order (``desc_act``) ``g_idx[i]`` names the group of input
  feature ``i`` and groups are not contiguous: we sort the input features by group and keep the
  permutation as the layer's ``perm`` (``y = x[..., perm] @ W.T``), as ExLlama does. mlx-lm
  refuses such checkpoints.
- AutoAWQ GEMM (``quant_method: awq``, 4 bits): ``qweight`` ``(in, out / 8)`` and ``qzeros``
  ``(n_groups, out / 8)`` pack 8 output features per word in the order ``0 2 4 6 1 3 5 7``.

Other tensors (norms, embeddings, an unquantized ``lm_head``) load unchanged.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxspec.errors import UnsupportedModelError
from mlxspec.quant import zp_format
from mlxspec.quant.storage import build_model, read_safetensors

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AutoAWQ word holds output feature AWQ_ORDER[k]


def is_checkpoint_config(config: dict) -> bool:
    """True for a Hugging Face config of an AutoGPTQ or AutoAWQ checkpoint."""
    qc = config.get("quantization_config")
    return (
        "quantization" not in config
        and isinstance(qc, dict)
        and str(qc.get("quant_method", "")).lower() in ("gptq", "awq")
    )


def _np(a) -> np.ndarray:
    a = np.array(a)
    return a.view(np.uint32) if a.dtype == np.int32 else a


def gptq_to_zero_point(
    qweight, qzeros, scales, g_idx, *, bits: int, group_size: int, zeros_minus_one: bool = True
) -> dict[str, mx.array]:
    """One AutoGPTQ layer as zero-point arrays ``{"weight", "scales", "zeros"[, "perm"]}``.

    Args:
        qweight: int32 ``(in * bits / 32, out)``; qzeros: int32 ``(n_groups, out * bits / 32)``;
        scales: float16 ``(n_groups, out)``; g_idx: int32 ``(in,)`` or None.
        zeros_minus_one: the checkpoint stores ``z - 1`` (``checkpoint_format: gptq``).
    """
    qweight, qzeros = _np(qweight), _np(qzeros)
    in_features = qweight.shape[0] * 32 // bits
    out_features = qweight.shape[1]
    n_groups = in_features // group_size
    q = zp_format.unpack(np.ascontiguousarray(qweight.T), bits, in_features)  # (out, in)
    z = zp_format.unpack(qzeros, bits, out_features).T  # (out, n_groups)
    if zeros_minus_one:
        z = (z.astype(np.int64) + 1) & (2**bits - 1)
    out = {"scales": mx.array(np.ascontiguousarray(_np(scales).T))}
    natural = np.arange(in_features) // group_size
    if g_idx is not None and not np.array_equal(np.array(g_idx), natural):
        g_idx = np.array(g_idx)
        perm = np.argsort(g_idx, kind="stable")
        if not np.array_equal(g_idx[perm], natural):
            raise UnsupportedModelError(
                f"g_idx does not put exactly {group_size} input features in each of the "
                f"{n_groups} groups: this GPTQ checkpoint is not supported"
            )
        q = q[:, perm]
        out["perm"] = mx.array(perm.astype(np.uint32))
    out["weight"] = mx.array(zp_format.pack(q, bits))
    out["zeros"] = mx.array(zp_format.pack(z, bits))
    return out


def _awq_unpack(packed: np.ndarray) -> np.ndarray:
    """AutoAWQ int32 ``(rows, cols / 8)`` -> uint8 ``(rows, cols)``."""
    rows, words = packed.shape
    nibbles = np.stack([(packed >> (4 * k)) & 0xF for k in range(8)], axis=-1)
    out = np.empty((rows, words, 8), np.uint8)
    out[..., list(AWQ_ORDER)] = nibbles
    return out.reshape(rows, words * 8)


def awq_to_zero_point(qweight, qzeros, scales) -> dict[str, mx.array]:
    """One AutoAWQ GEMM layer (4 bits) as zero-point arrays ``{"weight", "scales", "zeros"}``.

    Args: qweight int32 ``(in, out / 8)``, qzeros int32 ``(n_groups, out / 8)``, scales float16
    ``(n_groups, out)``.
    """
    q = _awq_unpack(_np(qweight)).T  # (out, in)
    z = _awq_unpack(_np(qzeros)).T  # (out, n_groups)
    return {
        "weight": mx.array(zp_format.pack(np.ascontiguousarray(q), 4)),
        "scales": mx.array(np.ascontiguousarray(_np(scales).T)),
        "zeros": mx.array(zp_format.pack(np.ascontiguousarray(z), 4)),
    }


def convert_weights(weights: dict[str, mx.array], quantization_config: dict) -> dict:
    """Rewrite an AutoGPTQ/AutoAWQ weight dict into zero-point weights (other tensors kept)."""
    method = str(quantization_config.get("quant_method", "")).lower()
    bits = int(quantization_config.get("bits", quantization_config.get("w_bit", 4)))
    group_size = int(
        quantization_config.get("group_size", quantization_config.get("q_group_size", 128))
    )
    if group_size not in zp_format.SUPPORTED_GROUP_SIZES:
        raise UnsupportedModelError(
            f"{method} checkpoint with group size {group_size}: mlxspec supports group sizes "
            f"{', '.join(map(str, zp_format.SUPPORTED_GROUP_SIZES))}"
        )
    if method == "awq":
        version = str(quantization_config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise UnsupportedModelError(
                f"AutoAWQ {version} checkpoint with {bits} bits: only 4-bit GEMM checkpoints load"
            )
    elif bits not in zp_format.SUPPORTED_BITS:
        raise UnsupportedModelError(f"{bits}-bit GPTQ checkpoint: mlxspec supports 2, 3, 4, 8 bits")
    checkpoint_format = quantization_config.get(
        "checkpoint_format", quantization_config.get("format", "gptq")
    )
    out = {}
    for key, value in weights.items():
        if not key.endswith(".qweight"):
            if not key.endswith((".qzeros", ".scales", ".g_idx")):
                out[key] = value
            continue
        path = key[: -len(".qweight")]
        if method == "awq":
            layer = awq_to_zero_point(value, weights[f"{path}.qzeros"], weights[f"{path}.scales"])
        else:
            layer = gptq_to_zero_point(
                value, weights[f"{path}.qzeros"], weights[f"{path}.scales"],
                weights.get(f"{path}.g_idx"), bits=bits, group_size=group_size,
                zeros_minus_one=checkpoint_format != "gptq_v2",
            )
        out.update({f"{path}.{name}": array for name, array in layer.items()})
    return out


def load(model_dir: Path, config: dict, lazy: bool):
    """Loader of AutoGPTQ/AutoAWQ checkpoints (see :mod:`mlxspec.load`)."""
    from mlx_lm.utils import load_config

    config = load_config(Path(model_dir))
    quantization_config = config.pop("quantization_config")
    weights = convert_weights(read_safetensors(model_dir), quantization_config)
    return build_model(model_dir, config, weights, lazy)
