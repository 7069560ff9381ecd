"""Convert a GGUF file (llama.cpp's format) into an MLX model directory that mlx-lm loads.

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", out_dir)   # -> out_dir
    out_dir/config.json              model_type "llama" or "gemma3_text", Hugging Face key names
    out_dir/model.safetensors        every tensor dequantized (float32 by default), HF tensor names
    out_dir/tokenizer.json           rebuilt with `tokenizers` from the GGUF vocabulary
    out_dir/tokenizer_config.json    bos/eos/unk/pad, add_bos_token, chat_template

What differs between a GGUF file and the Hugging Face checkpoint it came from, and is undone here:

- Tensor names (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``).
- llama: llama.cpp's converter permutes the rows of q_proj/k_proj so that each head's rotary pairs
  are adjacent, (x0, y0, x1, y1, ...), for ggml's interleaved RoPE. mlx-lm's llama applies
  half-split RoPE, (x0, x1, ..., y0, y1, ...), so the permutation is inverted.
- gemma3: llama.cpp stores every RMSNorm weight as ``1 + w`` (ggml multiplies by the weight);
  mlx-lm's Gemma computes ``1 + w`` itself, so 1 is subtracted.
- Hyper-parameters that llama.cpp hard-codes for gemma3 (sliding-window pattern, local RoPE base,
  query scale) are written into config.json explicitly.

The tokenizer is rebuilt from the metadata by ``mlxspec.gguf.tokenizer``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxspec.errors import (
    CorruptModelError,
    NotWritableError,
    UnsupportedModelError,
)
from mlxspec.gguf import tensors as gguf_quant
from mlxspec.gguf.checks import (
    MARKER,
    NOT_WRITABLE,
    check_loads,
    check_replaceable,
    check_shapes,
    clean_stale_work_dirs,
    positive_int,
    positive_number,
    work_dir_prefix,
)
from mlxspec.gguf.dtype import DTYPE_ENV, DTYPES, conversion_dtype
from mlxspec.gguf.reader import GGUFFile, read_gguf
from mlxspec.gguf.tokenizer import (
    build_tokenizer,
    check_tokenizer_metadata,
    eos_token_ids,
    tokenizer_config,
)
from mlxspec.progress import progress_bar

# Part of the cache key: bump when the converted output changes, so stale conversions are redone.
# 2: GGUF blocks kept quantized where the device prefers (gguf_quant); 3: float32 scales on the
# embedding table and output head (gguf_quant.STREAM_ENDS)
CONVERTER_VERSION = 3


# -- architectures --------------------------------------------------------------------------------

# GGUF layer tensor -> Hugging Face module path inside ``model.layers.<i>``.
_LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER_NAMES = {
    **_LLAMA_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _hf_name(gguf_name: str, layer_names: dict[str, str]) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name} has no mlx-lm counterpart")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k permutation: per head, rows (x0, y0, x1, y1, ...) -> (x..., y...).

    w: (n_heads * head_dim, ...) -- a q_proj/k_proj weight (or bias) as stored in the GGUF file.
    """
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _common_config(meta: dict, arch: str, gguf: GGUFFile) -> dict:
    heads = positive_int(meta, f"{arch}.attention.head_count")
    hidden = positive_int(meta, f"{arch}.embedding_length")
    kv_heads = positive_int(meta, f"{arch}.attention.head_count_kv", heads)
    if f"{arch}.attention.key_length" not in meta and hidden % heads:
        raise CorruptModelError(
            f"GGUF head count {heads} does not divide the embedding length {hidden}"
        )
    if heads % kv_heads:
        raise CorruptModelError(f"GGUF KV head count {kv_heads} does not divide {heads} heads")
    head_dim = positive_int(meta, f"{arch}.attention.key_length", hidden // heads)
    if head_dim % 2:
        raise CorruptModelError(f"GGUF head size {head_dim} is odd; RoPE needs pairs")
    if positive_int(meta, f"{arch}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError("GGUF key and value head sizes differ; mlx-lm needs them equal")
    if positive_int(meta, f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModelError("GGUF model applies RoPE to part of each head; not supported")
    if "rope_freqs.weight" in gguf.tensors:
        raise UnsupportedModelError("GGUF model has per-frequency RoPE factors (Llama 3.1 style)")
    if "token_embd.weight" not in gguf.tensors:
        raise CorruptModelError("GGUF file has no token_embd.weight (the embedding table)")
    return {
        "hidden_size": hidden,
        "num_hidden_layers": _block_count(meta, arch, gguf),
        "intermediate_size": positive_int(meta, f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": positive_number(meta, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": positive_number(meta, f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch),
        "max_position_embeddings": positive_int(meta, f"{arch}.context_length"),
        "vocab_size": gguf.tensors["token_embd.weight"].shape[0],
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
    }


def _block_count(meta: dict, arch: str, gguf: GGUFFile) -> int:
    """``{arch}.block_count``, which must match the ``blk.<i>`` tensors the file holds."""
    count = positive_int(meta, f"{arch}.block_count")
    found = {name.split(".")[1] for name in gguf.tensors if name.startswith("blk.")}
    if count != len(found) or found != {str(i) for i in range(count)}:
        raise CorruptModelError(
            f"GGUF {arch}.block_count is {count}, but the file holds tensors for "
            f"{len(found)} layers"
        )
    return count


def _rope_scaling(meta: dict, arch: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = positive_number(meta, f"{arch}.rope.scaling.factor", 1.0)
    if kind == "none" or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    raise UnsupportedModelError(f"GGUF RoPE scaling {kind!r} is not supported (only linear)")


def _llama_config(meta: dict, gguf: GGUFFile) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_common_config(meta, "llama", gguf),
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "mlp_bias": False,
    }


def _gemma3_config(meta: dict, gguf: GGUFFile) -> dict:
    config = _common_config(meta, "gemma3", gguf)
    # llama.cpp hard-codes these for gemma3 (llama-model.cpp); they are not in the file.
    big = config["num_hidden_layers"] == 62  # Gemma-3-27B scales queries by hidden/heads
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **config,
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"]
        if big
        else config["head_dim"],
        "sliding_window": positive_int(meta, "gemma3.attention.sliding_window"),
        "sliding_window_pattern": 6,  # every 6th layer attends globally
        "rope_local_base_freq": 10000.0,  # RoPE base of the sliding-window layers
    }


def _llama_weight(name: str, w: np.ndarray, config: dict) -> np.ndarray:
    if ".attn_q." in name:
        return unpermute_rope_rows(w, config["num_attention_heads"])
    if ".attn_k." in name:
        return unpermute_rope_rows(w, config["num_key_value_heads"])
    return w


def _gemma3_weight(name: str, w: np.ndarray, config: dict) -> np.ndarray:
    return w - 1.0 if name.endswith("norm.weight") else w  # stored as 1 + w (see module docstring)


@dataclass(frozen=True)
class Architecture:
    """How one GGUF ``general.architecture`` maps onto an mlx-lm model class."""

    config: Callable[[dict, GGUFFile], dict]
    layer_names: dict[str, str]
    fix_weight: Callable[[str, np.ndarray, dict], np.ndarray]  # (gguf name, weight, config)


ARCHITECTURES = {
    "llama": Architecture(_llama_config, _LLAMA_LAYER_NAMES, _llama_weight),
    "gemma3": Architecture(_gemma3_config, _GEMMA3_LAYER_NAMES, _gemma3_weight),
}
def save_weights(
    path: Path, gguf: GGUFFile, arch: Architecture, config: dict, dtype: str, progress: bool
) -> None:
    """Dequantize, fix and write every tensor into one safetensors file under its HF name.

    Tensors are streamed one at a time (peak memory: one tensor), every one cast to ``dtype``
    (norms too: a float32 norm would promote half activations back to float32).
    """
    plan, offset = {}, 0  # HF name -> (GGUF tensor, safetensors dtype, byte range)
    for name, tensor in gguf.tensors.items():
        kind = _SAFETENSORS_DTYPES[dtype]
        size = int(np.prod(tensor.shape)) * (4 if kind == "F32" else 2)
        plan[_hf_name(name, arch.layer_names)] = (tensor, kind, (offset, offset + size))
        offset += size
    header = {
        hf: {"dtype": kind, "shape": list(t.shape), "data_offsets": list(span)}
        for hf, (t, kind, span) in plan.items()
    }
    header_bytes = json.dumps({"__metadata__": {"format": "mlx"}, **header}).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with (open(path, "wb") as f,
          progress_bar("Dequantizing GGUF tensors", len(plan), progress) as advance):
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        for tensor, kind, _ in plan.values():
            w = arch.fix_weight(tensor.name, tensor.dequantize(), config)
            f.write(memoryview(np.ascontiguousarray(_cast(w, kind))).cast("B"))
            advance()


_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # for DTYPES


def _cast(w: np.ndarray, kind: str) -> np.ndarray:
    """float32 -> the bytes of safetensors dtype ``kind`` (bfloat16 as uint16, rounded to even)."""
    if kind == "F32":
        return w.astype(np.float32, copy=False)
    if kind == "F16":
        return w.astype(np.float16)
    bits = w.astype(np.float32, copy=False).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


# -- conversion -----------------------------------------------------------------------------------


def gguf_cache_key(gguf_path: str | Path) -> str:
    """A short directory name for ``gguf_path``'s conversion: the file's stem and a hash of its
    resolved path, size, modification time and the converter version (no content read)."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    mode = gguf_quant.import_mode()  # dense and quantized conversions are different directories
    if mode == "quantized":
        mode += ",".join(map(str, gguf_quant.packed_bits()))
    # so are the dtypes of a CPU's and Metal's conversions (conversion_dtype)
    dtype = os.environ.get(DTYPE_ENV, "") or ("metal" if mx.metal.is_available() else "")
    fingerprint = f"{CONVERTER_VERSION}:{mode}:{dtype}:{path}:{stat.st_size}:{stat.st_mtime_ns}"
    return f"{path.stem}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}"


def convert_gguf(
    gguf_path: str | Path, out_dir: Path, dtype: str | None = None, progress: bool = True
) -> Path:
    """Convert a GGUF file into an MLX model directory that ``mlx_lm.utils.load`` opens.

    Args:
        gguf_path: a llama.cpp GGUF file (architecture llama or gemma3).
        out_dir: the directory to create. An existing one is replaced only if it is empty or an
            earlier mlxspec conversion (it holds ``MARKER``); anything else raises
            OutputExistsError untouched. The output is written into a work directory beside it,
            checked to load, and renamed into place, so an interrupted or failed conversion leaves
            nothing at ``out_dir``.
        dtype: dtype of the floating-point weights ("float32", "float16" or "bfloat16"); None:
            :func:`conversion_dtype` for the file's architecture on this device.
        progress: show a progress bar while dequantizing.

    Returns:
        ``out_dir``.

    Raises:
        CorruptModelError: the file is unreadable, truncated, or any field is invalid (every
            metadata field and tensor shape is checked before anything is written).
        UnsupportedModelError: the architecture, a tensor type or the tokenizer is not supported.
        OutputExistsError: ``out_dir`` holds something mlxspec did not create.
        NotWritableError: ``out_dir``'s parent is read-only or full.
    """
    if dtype is not None and dtype not in DTYPES:
        raise UnsupportedModelError(
            f"dtype {dtype!r} is not supported (float32, float16, bfloat16)"
        )
    out_dir = Path(out_dir)
    gguf = read_gguf(gguf_path)
    meta = gguf.metadata
    arch_name = meta.get("general.architecture")
    if not isinstance(arch_name, str):
        raise CorruptModelError(
            f"{gguf_path}: general.architecture is {arch_name!r}, not an architecture name"
        )
    if arch_name not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch_name!r} is not supported ({', '.join(ARCHITECTURES)})"
        )
    arch = ARCHITECTURES[arch_name]
    dtype = dtype or conversion_dtype(arch_name)
    try:
        config = arch.config(meta, gguf)
    except KeyError as e:
        raise CorruptModelError(f"{gguf_path} lacks {e.args[0]}, which {arch_name} needs") from None
    check_tokenizer_metadata(meta, rows=config["vocab_size"])
    eos_ids = eos_token_ids(meta)
    config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if "tokenizer.ggml.bos_token_id" in meta:
        config["bos_token_id"] = meta["tokenizer.ggml.bos_token_id"]
    check_shapes(
        {_hf_name(name, arch.layer_names): t.shape for name, t in gguf.tensors.items()}, config
    )
    tokenizer = build_tokenizer(meta)

    check_replaceable(out_dir)
    try:
        _write_conversion(gguf, arch, config, meta, tokenizer, out_dir, dtype, progress)
    except OSError as e:
        if e.errno not in NOT_WRITABLE:
            raise
        raise NotWritableError(
            f"cannot write the converted model to {out_dir.parent}: {e.strerror}; free some "
            "space or choose a writable directory (MLXSPEC_HOME for mlxspec's cache)"
        ) from None
    return out_dir


def _write_conversion(gguf, arch, config, meta, tokenizer, out_dir, dtype, progress) -> None:
    """Write everything into a work directory beside ``out_dir``, then rename it into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_work_dirs(out_dir.parent)
    prefix = work_dir_prefix(out_dir)
    staging = Path(tempfile.mkdtemp(prefix=prefix, suffix=".partial", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        if gguf_quant.import_mode() == "quantized":  # the GGUF's blocks as MLX quantized weights
            names = {name: _hf_name(name, arch.layer_names) for name in gguf.tensors}
            config["quantization"] = gguf_quant.save_weights(
                staging / "model.safetensors", gguf, names, arch.fix_weight, config, dtype, progress)
        else:
            save_weights(staging / "model.safetensors", gguf, arch, config, dtype, progress)
        _write_json(staging / "config.json", {**config, "torch_dtype": dtype})
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", tokenizer_config(meta))
        (staging / MARKER).write_text(f"mlxspec GGUF conversion, converter {CONVERTER_VERSION}\n")
        check_loads(staging)
        check_replaceable(out_dir)  # again: something may have appeared meanwhile
        if out_dir.exists():  # replace: move the old one aside first, delete it after
            old = Path(tempfile.mkdtemp(prefix=prefix, suffix=".old", dir=out_dir.parent))
            os.replace(out_dir, old / "dir")
            os.replace(staging, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
