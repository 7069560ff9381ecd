"""mlxspec.cpu.layers: a Llama block as four ops gives the unfused block's bits (logits and KV
cache), matches a float64 numpy layer, takes the KV cache's buffer over instead of copying it,
and steps aside wherever it does not apply."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from llama_toys import tiny_llama
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlxspec import cpu
from mlxspec.cache import make_cache
from mlxspec.cpu import layers, quantized

pytestmark = pytest.mark.skipif(not quantized.enable(),
                                reason=f"no packed-weight kernel here: {quantized.describe()}")


def quantized_toy(bits: int, group_size: int, scale_dtype=mx.float32, seed: int = 0):
    """A random 2-layer llama (hidden 128, 4 heads of 32, 2 KV heads), its projections quantized,
    prepared as mlxspec.load prepares a model."""
    model = tiny_llama(seed, hidden=128, vocab=96)
    nn.quantize(model, group_size=group_size, bits=bits,
                class_predicate=lambda path, m: isinstance(m, nn.Linear) and "lm_head" not in path)
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            m.scales, m.biases = m.scales.astype(scale_dtype), m.biases.astype(scale_dtype)
    mx.eval(model.parameters())
    cpu.prepare(model)
    return model


def decode(model, prompt, steps, monkeypatch, fused: bool, block: int = 1, step: int | None = None):
    """Greedy decoding (``block`` tokens a pass: the next token repeated, the extra rows then
    trimmed, as a speculative pass verifies drafts): every pass's logits and the final caches."""
    monkeypatch.setenv(layers.SWITCH, "1" if fused else "0")
    cache = make_cache(model)
    if step is not None:
        for c in cache:
            c.step = step  # the buffer grows every `step` tokens: the unfused layer does it
    logits = model(mx.array([prompt]), cache=cache)
    mx.eval(logits)  # the prompt's graph (holding the cache's buffer) done, as generation does
    seen = [logits]
    for _ in range(steps):
        token = mx.argmax(logits[:, -1], axis=-1)
        logits = model(mx.repeat(token[:, None], block, axis=1), cache=cache)
        for c in cache:
            c.trim(block - 1)
        mx.eval(logits)
        seen.append(logits)
    return seen, cache


def _vnni() -> bool:
    return quantized.enable() and bool(quantized._state["module"].int8_activations)


@pytest.mark.parametrize("bits,group_size,scale_dtype,activations", [
    (4, 32, mx.float16, "float32"), (4, 64, mx.float32, "float32"),
    (8, 64, mx.bfloat16, "float32"), (8, 128, mx.float32, "float32"),
    pytest.param(4, 32, mx.float16, "int8", marks=pytest.mark.skipif(not _vnni(), reason="no VNNI")),
    pytest.param(8, 64, mx.float32, "int8", marks=pytest.mark.skipif(not _vnni(), reason="no VNNI"))])
def test_fused_blocks_give_the_unfused_bits_every_step(bits, group_size, scale_dtype, activations,
                                                       monkeypatch):
    monkeypatch.setenv(quantized.ACTIVATIONS, activations)  # int8: x rounded in both paths
    model = quantized_toy(bits, group_size, scale_dtype)
    assert all(type(layer) is layers.LlamaBlock for layer in model.model.layers)
    copies = layers.cache_copies()
    for block in (1, 3):
        fused, fused_cache = decode(model, [1, 5, 9, 2, 7], 20, monkeypatch, True, block, step=8)
        plain, plain_cache = decode(model, [1, 5, 9, 2, 7], 20, monkeypatch, False, block, step=8)
        assert all(mx.array_equal(a, b).item() for a, b in zip(fused, plain, strict=True))
        for a, b in zip(fused_cache, plain_cache, strict=True):
            assert a.offset == b.offset
            assert mx.array_equal(a.keys[..., :a.offset, :], b.keys[..., :b.offset, :]).item()
            assert mx.array_equal(a.values[..., :a.offset, :], b.values[..., :b.offset, :]).item()
    assert layers.cache_copies() == copies  # each step wrote into the cache's own buffer


def _dequantized(proj) -> np.ndarray:
    """W = s q + b with float32 scales and biases (float16 ones would round W to float16)."""
    return np.array(mx.dequantize(proj.weight, proj.scales.astype(mx.float32),
                                  proj.biases.astype(mx.float32), proj.group_size, proj.bits),
                    dtype=np.float64)


def _numpy_layer(layer, x, keys, values, offset):
    """One Llama block in float64 for x (M, D) at positions offset.., attending to the cached
    keys/values (KV, offset, hd) and its own rows (causal). Returns (out, keys, values)."""
    attn = layer.self_attn
    heads, kv, eps = attn.n_heads, attn.n_kv_heads, layer.input_layernorm.eps

    def norm(v, w):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps) * np.array(w, np.float64)

    def rope(v):  # (M, H, hd), non-traditional: pairs (i, i + hd / 2)
        hd = v.shape[-1]
        freqs = attn.rope.base ** (-np.arange(0, hd, 2) / hd)
        angles = (offset + np.arange(v.shape[0]))[:, None] * freqs[None]
        c, s = np.cos(angles)[:, None], np.sin(angles)[:, None]
        a, b = v[..., : hd // 2], v[..., hd // 2:]
        return np.concatenate([a * c - b * s, a * s + b * c], -1)

    M = x.shape[0]
    h = norm(x, layer.input_layernorm.weight)
    q = rope((h @ _dequantized(attn.q_proj).T).reshape(M, heads, -1))
    k = rope((h @ _dequantized(attn.k_proj).T).reshape(M, kv, -1))
    v = (h @ _dequantized(attn.v_proj).T).reshape(M, kv, -1)
    keys = np.concatenate([keys, k.transpose(1, 0, 2)], 1)
    values = np.concatenate([values, v.transpose(1, 0, 2)], 1)
    group, out = heads // kv, np.empty_like(q)
    for head in range(heads):
        scores = q[:, head] @ keys[head // group].T * attn.scale  # (M, offset + M)
        scores[np.arange(M)[:, None] + offset < np.arange(keys.shape[1])[None]] = -np.inf
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, head] = (p / p.sum(-1, keepdims=True)) @ values[head // group]
    x = x + out.reshape(M, -1) @ _dequantized(attn.o_proj).T
    h = norm(x, layer.post_attention_layernorm.weight)
    mlp = layer.mlp
    gate = h @ _dequantized(mlp.gate_proj).T
    up = h @ _dequantized(mlp.up_proj).T
    return x + (gate / (1 + np.exp(-gate)) * up) @ _dequantized(mlp.down_proj).T, keys, values


@pytest.mark.parametrize("rows", [1, 4])
def test_a_fused_block_matches_a_float64_numpy_layer(rows):
    model = quantized_toy(4, 32, mx.float16, seed=3)
    layer = model.model.layers[1]
    cache = KVCache()
    context = mx.random.normal((1, 9, 128), key=mx.random.key(1))
    layer(context, mask="causal", cache=cache)  # unfused: the first rows and the buffer
    mx.eval(cache.keys, cache.values)
    keys = np.array(cache.keys[0, :, :9], np.float64)
    values = np.array(cache.values[0, :, :9], np.float64)
    x = mx.random.normal((1, rows, 128), key=mx.random.key(2))
    got = layer(x, mask="causal" if rows > 1 else None, cache=cache)
    want, want_keys, want_values = _numpy_layer(layer, np.array(x[0], np.float64), keys, values, 9)
    assert cache.offset == 9 + rows
    # float32 throughout: errors of a few float32 steps of each value's size; a misplaced row,
    # head or position is off by the values themselves
    np.testing.assert_allclose(np.array(got[0]), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    np.testing.assert_allclose(np.array(cache.keys[0, :, :9 + rows]), want_keys, rtol=1e-4,
                               atol=1e-4 * np.abs(want_keys).max())
    np.testing.assert_allclose(np.array(cache.values[0, :, :9 + rows]), want_values, rtol=1e-4,
                               atol=1e-4 * np.abs(want_values).max())


def test_what_the_fused_block_does_not_take_runs_unfused_with_the_same_results(monkeypatch):
    """A mask array, a batch of two, a rotating cache, the first pass (no buffer yet), more rows
    than the kernel's 24, a projection replaced after install: the unfused block's numbers,
    whichever path ran."""
    model = quantized_toy(4, 64)
    layer = model.model.layers[0]
    x = mx.random.normal((2, 3, 128), key=mx.random.key(4))

    def both(call):
        monkeypatch.setenv(layers.SWITCH, "1")
        fused = call()
        monkeypatch.setenv(layers.SWITCH, "0")
        return fused, call()

    def run(inputs, cache_type, mask=None, warm=4):
        cache = cache_type()
        if warm:
            layer(mx.zeros((inputs.shape[0], warm, 128)), mask="causal", cache=cache)
        return layer(inputs, mask=mask, cache=cache)

    bool_mask = mx.array([[True, False, True, True, True, True, True]])
    cases = [lambda: run(x[:1], KVCache, mask=bool_mask), lambda: run(x, KVCache, "causal"),
             lambda: run(x[:1], lambda: RotatingKVCache(max_size=16), "causal"),
             lambda: run(x[:1], KVCache, "causal", warm=0),
             lambda: run(mx.random.normal((1, 30, 128), key=mx.random.key(5)), KVCache, "causal")]
    for case in cases:
        fused, plain = both(case)
        assert mx.array_equal(fused, plain).item()
    layer.mlp.up_proj = nn.Linear(128, 256, bias=False)  # replaced after install (a shard, say)
    fused, plain = both(lambda: run(x[:1], KVCache, "causal"))
    assert mx.array_equal(fused, plain).item()


def test_switches_keep_the_unfused_block(monkeypatch):
    model = quantized_toy(4, 64)
    assert layers.enabled()
    monkeypatch.setenv(quantized.SWITCH, "0")
    assert not layers.enabled()
    monkeypatch.delenv(quantized.SWITCH)
    monkeypatch.setenv(layers.SWITCH, "0")
    assert not layers.enabled() and "off" in layers.describe()
    fresh = tiny_llama(1, hidden=128, vocab=96)
    nn.quantize(fresh, group_size=64, bits=4)
    quantized.install(fresh)
    assert layers.install(fresh) == 0  # switched off: nothing swapped
    monkeypatch.delenv(layers.SWITCH)
    assert layers.install(fresh) == 2
    unquantized = tiny_llama(2, hidden=128, vocab=96)
    assert layers.install(unquantized) == 0  # dense projections: nothing to fuse
    assert all(type(layer) is llama.TransformerBlock for layer in unquantized.model.layers)
    assert type(model.model.layers[0]) is layers.LlamaBlock


def test_the_default_model_decodes_as_before_with_fused_blocks(monkeypatch):
    """SmolLM2-135M as mlxspec.load gives it (packed 4-bit): 30 fused blocks; greedy decoding and
    a 4-token verification pass give the unfused logits bitwise, with no cache copied."""
    import mlxspec

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXSPEC_GGUF_WEIGHTS", "quantized")
        model, tokenizer = mlxspec.load()
    assert sum(type(m) is layers.LlamaBlock for m in model.model.layers) == 30
    prompt = tokenizer.encode("The three primary colors are")
    copies = layers.cache_copies()
    for block in (1, 4):
        fused, _ = decode(model, prompt, 6, monkeypatch, True, block)
        plain, _ = decode(model, prompt, 6, monkeypatch, False, block)
        assert all(mx.array_equal(a, b).item() for a, b in zip(fused, plain, strict=True))
    assert layers.cache_copies() == copies
    monkeypatch.delenv(layers.SWITCH)
    assert "Llama layers as 4 ops" in cpu.report(measure=False)["llama_layers"]
