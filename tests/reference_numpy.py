"""Float64 numpy forward passes of GGUF models, read straight from the GGUF tensors.

An independent reference for ``mlxspec.gguf.convert``: it reads the file with ``gguf.GGUFReader`` (not
mlxspec's parser) and follows llama.cpp's graph, not mlx-lm's, so every fix the converter makes is
checked rather than repeated:

- llama: q/k rows are used as stored (permuted) and rotated with ggml's interleaved RoPE, which
  rotates adjacent pairs (x[2i], x[2i+1]); mlx-lm rotates halves (x[i], x[i + d/2]).
- gemma3: norm weights are used as stored (llama.cpp multiplies by the weight, which the GGUF
  converter stored as 1 + w); RoPE is NEOX style (halves).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, gguf_reader
from gguf.quants import dequantize


def read_gguf(path) -> GGUFReader:
    """``gguf.GGUFReader`` over the file read into memory rather than mapped: the reader slices its
    data once per vocabulary entry, and a memmap's slice costs several times an array's
    (Gemma-3's 262k tokens: ~15 s mapped, ~6 s in memory; the parse is the same). The reader
    calls ``np.memmap`` itself, so ``numpy.memmap`` is replaced while it is built."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_reader.np, "memmap", lambda file, mode="r": np.fromfile(file, np.uint8))
        return GGUFReader(path)


class GGUFModel:
    """Metadata and tensors of a GGUF file read by ``gguf.GGUFReader``, dequantized on use."""

    def __init__(self, reader: GGUFReader):
        self.meta = {
            key: field.contents()
            for key, field in reader.fields.items()
            if not key.startswith("tokenizer.")
        }
        self.tensors = {t.name: t for t in reader.tensors}

    def w(self, name: str, rows: list[int] | slice = slice(None)) -> np.ndarray:
        """Tensor ``name`` (or some of its rows) as float64, numpy order (rows first)."""
        t = self.tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        data = np.asarray(t.data).reshape(shape[0], -1)[rows]  # a row per output feature, quantized
        return dequantize(data, t.tensor_type).astype(np.float64).reshape(-1, *shape[1:])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_angles(positions: np.ndarray, dims: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape (T, dims/2): angle of pair i at position p is p * base^(-2i/dims)."""
    freqs = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    angles = positions[:, None] * freqs[None, :]
    return np.cos(angles), np.sin(angles)


def rope_interleaved(x: np.ndarray, base: float) -> np.ndarray:
    """ggml's normal RoPE: x (T, heads, d); rotates pairs (x[2i], x[2i+1])."""
    cos, sin = rope_angles(np.arange(x.shape[0], dtype=np.float64), x.shape[-1], base)
    cos, sin = cos[:, None, :], sin[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def rope_neox(x: np.ndarray, base: float) -> np.ndarray:
    """NEOX RoPE: x (T, heads, d); rotates pairs (x[i], x[i + d/2])."""
    cos, sin = rope_angles(np.arange(x.shape[0], dtype=np.float64), x.shape[-1], base)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def attention(q, k, v, scale: float, window: int | None = None) -> np.ndarray:
    """Causal grouped-query attention. q (T, H, d), k/v (T, KV, d) -> (T, H * d).

    Query head h reads key/value head h // (H // KV). With ``window``, position i sees only
    positions j with i - j < window.
    """
    T, H, d = q.shape
    group = H // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, k) * scale
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (j <= i) if window is None else (j <= i) & (i - j < window)
    scores = np.where(allowed[None], scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", probs, v).reshape(T, H * d)


def _heads(x: np.ndarray, n: int) -> np.ndarray:
    return x.reshape(x.shape[0], n, -1)


def _logits(model: GGUFModel, x: np.ndarray, chunk: int = 32768) -> np.ndarray:
    """x (T, hidden) times the output matrix (the embedding when tied), a vocabulary chunk at a time."""
    name = "output.weight" if "output.weight" in model.tensors else "token_embd.weight"
    vocab = int(model.tensors[name].shape[-1])
    return np.concatenate(
        [x @ model.w(name, slice(i, i + chunk)).T for i in range(0, vocab, chunk)], axis=-1
    )


def llama_logits(model: GGUFModel, tokens: list[int]) -> np.ndarray:
    """Logits (T, vocab) float64 of a llama-architecture GGUF model on ``tokens``."""
    m = model.meta
    n_head = m["llama.attention.head_count"]
    n_kv = m.get("llama.attention.head_count_kv", n_head)
    eps = m["llama.attention.layer_norm_rms_epsilon"]
    base = m.get("llama.rope.freq_base", 10000.0)
    x = model.w("token_embd.weight", tokens)
    for layer in range(m["llama.block_count"]):
        p = f"blk.{layer}."
        h = rms_norm(x, model.w(p + "attn_norm.weight"), eps)
        q = rope_interleaved(_heads(h @ model.w(p + "attn_q.weight").T, n_head), base)
        k = rope_interleaved(_heads(h @ model.w(p + "attn_k.weight").T, n_kv), base)
        v = _heads(h @ model.w(p + "attn_v.weight").T, n_kv)
        x = x + attention(q, k, v, q.shape[-1] ** -0.5) @ model.w(p + "attn_output.weight").T
        h = rms_norm(x, model.w(p + "ffn_norm.weight"), eps)
        gate = h @ model.w(p + "ffn_gate.weight").T
        silu = gate / (1.0 + np.exp(-gate))
        x = x + (silu * (h @ model.w(p + "ffn_up.weight").T)) @ model.w(p + "ffn_down.weight").T
    return _logits(model, rms_norm(x, model.w("output_norm.weight"), eps))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def gemma3_logits(
    model: GGUFModel, tokens: list[int], layers: int | None = None, embed_scale: float | None = None
) -> np.ndarray:
    """Logits (T, vocab) float64 of a gemma3 GGUF model on ``tokens``, through the first
    ``layers`` blocks (all by default).

    Constants llama.cpp hard-codes for gemma3: every 6th layer is global (RoPE base from the file),
    the others use a sliding window and RoPE base 10000; queries are scaled by head_dim^-0.5.
    ``embed_scale`` defaults to llama.cpp's sqrt(hidden).
    """
    m = model.meta
    n_head, n_kv = m["gemma3.attention.head_count"], m["gemma3.attention.head_count_kv"]
    eps = m["gemma3.attention.layer_norm_rms_epsilon"]
    hidden = m["gemma3.embedding_length"]
    head_dim = m["gemma3.attention.key_length"]
    window = m["gemma3.attention.sliding_window"]
    x = model.w("token_embd.weight", tokens)
    x = x * (np.sqrt(hidden) if embed_scale is None else embed_scale)
    n_layers = m["gemma3.block_count"] if layers is None else layers
    for layer in range(n_layers):
        p = f"blk.{layer}."
        is_global = (layer + 1) % 6 == 0
        base = m["gemma3.rope.freq_base"] if is_global else 10000.0
        h = rms_norm(x, model.w(p + "attn_norm.weight"), eps)
        q = _heads(h @ model.w(p + "attn_q.weight").T, n_head)
        k = _heads(h @ model.w(p + "attn_k.weight").T, n_kv)
        v = _heads(h @ model.w(p + "attn_v.weight").T, n_kv)
        q = rope_neox(rms_norm(q, model.w(p + "attn_q_norm.weight"), eps), base)
        k = rope_neox(rms_norm(k, model.w(p + "attn_k_norm.weight"), eps), base)
        a = attention(q, k, v, head_dim**-0.5, None if is_global else window)
        a = a @ model.w(p + "attn_output.weight").T
        x = x + rms_norm(a, model.w(p + "post_attention_norm.weight"), eps)
        h = rms_norm(x, model.w(p + "ffn_norm.weight"), eps)
        f = gelu_tanh(h @ model.w(p + "ffn_gate.weight").T) * (h @ model.w(p + "ffn_up.weight").T)
        f = f @ model.w(p + "ffn_down.weight").T
        x = x + rms_norm(f, model.w(p + "post_ffw_norm.weight"), eps)
    return _logits(model, rms_norm(x, model.w("output_norm.weight"), eps))
