"""MTP layers shipped inside a checkpoint (MiMo's ``model.mtp_layers.*``): kept at load, run as a
feature draft (``--draft mtp``), lossless. The model is a tiny random MiMo written in that
layout (no such checkpoint is offline); the reference is a float64 numpy MTP layer written from
vLLM's ``mimo_mtp.py`` definition."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import mimo
from speculative_helpers import plain_tokens, spec_tokens
from tiny_models import save_tiny, tiny_config

from mlxspec.errors import CorruptModelError, UnsupportedModelError
from mlxspec.load import load
from mlxspec.speculative import SpecStats
from mlxspec.speculative.feature import tapped_forward
from mlxspec.speculative.heads import make_feature_drafter

HIDDEN, HEADS, KV = 64, 4, 2


def _mtp_weights(seed: int, hidden: int = HIDDEN) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, ff = hidden // HEADS, 2 * hidden

    def w(*shape, scale=0.2):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    layer = {
        "token_layernorm.weight": 1 + w(hidden), "hidden_layernorm.weight": 1 + w(hidden),
        "input_proj.weight": w(hidden, 2 * hidden), "final_layernorm.weight": 1 + w(hidden),
        "input_layernorm.weight": 1 + w(hidden), "post_attention_layernorm.weight": 1 + w(hidden),
        "self_attn.q_proj.weight": w(HEADS * d, hidden), "self_attn.q_proj.bias": w(HEADS * d),
        "self_attn.k_proj.weight": w(KV * d, hidden), "self_attn.k_proj.bias": w(KV * d),
        "self_attn.v_proj.weight": w(KV * d, hidden), "self_attn.v_proj.bias": w(KV * d),
        "self_attn.o_proj.weight": w(hidden, HEADS * d),
        "mlp.gate_proj.weight": w(ff, hidden), "mlp.up_proj.weight": w(ff, hidden),
        "mlp.down_proj.weight": w(hidden, ff),
    }
    return {f"model.mtp_layers.0.{k}": v for k, v in layer.items()}


def write_mimo(path, with_mtp: bool = True, **changes):
    """A tiny random MiMo (tied embeddings, byte tokenizer) and, in a second safetensors file
    as MiMo's checkpoints hold it, one MTP layer."""
    config = tiny_config(model_type="mimo", num_nextn_predict_layers=1, num_hidden_layers=3,
                         hidden_size=HIDDEN, intermediate_size=2 * HIDDEN)
    mx.random.seed(0)
    model = mimo.Model(mimo.ModelArgs.from_dict(config))
    model.model.embed_tokens.weight = 0.25 * mx.random.normal(model.model.embed_tokens.weight.shape)
    mx.eval(model.parameters())
    save_tiny(model, config, path)
    weights = _mtp_weights(1)
    weights.update(changes)
    if with_mtp:
        mx.save_safetensors(str(path / "model-mtp.safetensors"),
                            {k: mx.array(v) for k, v in weights.items()})
    return weights


def _rms(x, w, eps=1e-5):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, positions, base=10000.0):
    """mlx's non-traditional RoPE (rotate the two halves) of (T, heads, d) at ``positions``."""
    d = x.shape[-1]
    freqs = base ** (-np.arange(0, d, 2) / d)
    angle = positions[:, None, None] * freqs
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                           x1 * np.sin(angle) + x2 * np.cos(angle)], axis=-1)


def reference_mtp_logits(weights, embed, last_hidden, final_norm, tokens) -> np.ndarray:
    """float64 numpy logits of the MTP layer at positions 0..T-1 (vLLM's mimo_mtp.py):
    last_hidden (T, H) the target's last layer output (pre-norm), tokens (T,) token p + 1."""
    W = {k.removeprefix("model.mtp_layers.0."): np.asarray(v, np.float64) for k, v in weights.items()}
    T, d = len(tokens), HIDDEN // HEADS
    e = embed[tokens].copy()
    e[0] = 0.0  # position 0's embedding is masked
    h = _rms(_rms(last_hidden, final_norm), W["hidden_layernorm.weight"])
    x = np.concatenate([h, _rms(e, W["token_layernorm.weight"])], -1) @ W["input_proj.weight"].T
    z = _rms(x, W["input_layernorm.weight"])
    q = (z @ W["self_attn.q_proj.weight"].T + W["self_attn.q_proj.bias"]).reshape(T, HEADS, d)
    k = (z @ W["self_attn.k_proj.weight"].T + W["self_attn.k_proj.bias"]).reshape(T, KV, d)
    v = (z @ W["self_attn.v_proj.weight"].T + W["self_attn.v_proj.bias"]).reshape(T, KV, d)
    pos = np.arange(T, dtype=np.float64)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = np.repeat(k, HEADS // KV, axis=1), np.repeat(v, HEADS // KV, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    scores = scores + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attn = np.einsum("hts,shd->thd", p, v).reshape(T, -1) @ W["self_attn.o_proj.weight"].T
    x = x + attn
    y = _rms(x, W["post_attention_layernorm.weight"])
    gate, up = y @ W["mlp.gate_proj.weight"].T, y @ W["mlp.up_proj.weight"].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ W["mlp.down_proj.weight"].T
    return _rms(x, W["final_layernorm.weight"]) @ embed.T  # tied output head


def test_mtp_layers_are_kept_at_load_and_draft_as_the_reference(tmp_path):
    weights = write_mimo(tmp_path / "mimo")
    model, tokenizer = load(str(tmp_path / "mimo"))
    assert len(model.mtp_layers) == 1
    assert not any("mtp" in k for k, _ in tree_flatten(model.parameters()))  # not the model's
    drafter = make_feature_drafter("mtp", model, tokenizer)
    tokens = [5, 9, 2, 7, 1, 40]
    _, features = tapped_forward(model, mx.array(tokens)[None], None, drafter.head.config.taps)
    cache = [drafter.cache[0]]
    out = drafter.head.step(mx.array(tokens[1:])[None], features[:, :-1], cache, features=True)
    got = np.array(drafter.head.logits(out)[0], np.float64)
    embed = np.array(model.model.embed_tokens.weight, np.float64)
    want = reference_mtp_logits(weights, embed, np.array(features[0, :-1], np.float64),
                                np.array(model.model.norm.weight, np.float64),
                                np.array(tokens[1:]))
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("k", [2, "auto"])
def test_greedy_mtp_draft_equals_plain_greedy_over_200_tokens(tmp_path, k):
    write_mimo(tmp_path / "mimo")
    model, tokenizer = load(str(tmp_path / "mimo"))
    drafter = make_feature_drafter("mtp", model, tokenizer)
    prompt = tokenizer.encode("Tell me about the sea.")
    stats = SpecStats()
    assert spec_tokens(model, drafter, prompt, 220, k=k, stats=stats) == \
        plain_tokens(model, prompt, 220)
    if k != "auto":
        assert stats.drafted > 0


def test_a_model_without_mtp_layers_refuses_draft_mtp_in_one_line(tmp_path):
    write_mimo(tmp_path / "mimo", with_mtp=False)
    model, tokenizer = load(str(tmp_path / "mimo"))
    with pytest.raises(UnsupportedModelError) as caught:
        make_feature_drafter("mtp", model, tokenizer)
    assert "\n" not in str(caught.value) and "MTP" in str(caught.value)


def test_misshapen_mtp_weights_are_one_error_line(tmp_path):
    write_mimo(tmp_path / "mimo", **{"model.mtp_layers.0.input_proj.weight":
                                     np.zeros((HIDDEN, HIDDEN), np.float32)})
    with pytest.raises(CorruptModelError) as caught:
        load(str(tmp_path / "mimo"))
    assert "\n" not in str(caught.value) and "MTP" in str(caught.value)
    config = json.loads((tmp_path / "mimo" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
