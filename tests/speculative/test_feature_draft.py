"""Feature drafts (EAGLE-3): the tapped target forward, published-layout heads, losslessness.

References are independent: the target model's own forward, a float64 numpy forward of the head
written from the published layout's definition, plain greedy decoding, and the exact joint
distribution of plain sampling (float64 numpy, as in test_speculative_sampling).
"""

from __future__ import annotations

import json
from collections import deque

import mlx.core as mx
import numpy as np
import pytest
from chi_square import chi_square_pvalue
from llama_toys import tiny_llama
from mlx_lm.sample_utils import make_logits_processors
from speculative_helpers import plain_tokens, record_proposals, spec_tokens
from test_speculative_sampling import BIAS, PENALTY, PROMPT, SAMPLING, exact_joint

from mlxspec.cache import make_cache
from mlxspec.errors import (
    CorruptModelError,
    ModelNotFoundError,
    TokenizerMismatchError,
    UnsupportedModelError,
)
from mlxspec.sampling import SamplingParams
from mlxspec.speculative import SpecStats, speculative_generate_step
from mlxspec.speculative.eagle3 import load_head
from mlxspec.speculative.feature import FeatureDrafter, tapped_forward

HIDDEN, LAYERS = 32, 4
TAPS = [0, 2, 4]


def _head_weights(vocab: int, draft_ids: list[int], seed: int = 3, scale: float = 0.3):
    """Random weights under the published names (SpecForge / vLLM ``LlamaForCausalLMEagle3``)."""
    rng = np.random.default_rng(seed)
    H, heads, kv, ff = HIDDEN, 4, 2, 64
    d = H // heads

    def w(*shape):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    weights = {
        "fc.weight": w(H, 3 * H), "norm.weight": 1 + w(H), "lm_head.weight": 4 * w(len(draft_ids), H),
        "midlayer.input_layernorm.weight": 1 + w(H), "midlayer.hidden_norm.weight": 1 + w(H),
        "midlayer.post_attention_layernorm.weight": 1 + w(H),
        "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, heads * d),
        "midlayer.mlp.gate_proj.weight": w(ff, H), "midlayer.mlp.up_proj.weight": w(ff, H),
        "midlayer.mlp.down_proj.weight": w(H, ff),
    }
    weights["d2t"] = np.array(draft_ids, np.int64) - np.arange(len(draft_ids))
    t2d = np.zeros(vocab, bool)
    t2d[draft_ids] = True
    weights["t2d"] = t2d
    return weights


def write_published_head(path, vocab: int, draft_ids: list[int], **config_changes):
    """A head directory as SpecForge writes it: config.json + model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
        "vocab_size": vocab, "draft_vocab_size": len(draft_ids), "tie_word_embeddings": False,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "torch_dtype": "float16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": TAPS, "use_aux_hidden_state": True},
    }
    config.update(config_changes)
    (path / "config.json").write_text(json.dumps(config))
    weights = _head_weights(vocab, draft_ids)
    mx.save_safetensors(str(path / "model.safetensors"),
                        {k: mx.array(v) for k, v in weights.items()})
    return weights


class ToyTokenizer:
    def __init__(self, vocab: int):
        self.vocab = vocab
        self.bos_token_id, self.eos_token_id, self.pad_token_id = None, 0, None
        self.eos_token_ids = [0]

    def get_vocab(self):
        return {f"t{i}": i for i in range(self.vocab)}


def _rms(x, w, eps=1e-5):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def reference_first_logits(weights, embed, features, token) -> np.ndarray:
    """float64 numpy: the head's target-vocabulary logits at a lone first position (its one
    key is itself, so attention returns v; RoPE at position 0 is the identity)."""
    W = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    hidden = W["fc.weight"] @ features
    x = np.concatenate([_rms(embed[token], W["midlayer.input_layernorm.weight"]),
                        _rms(hidden, W["midlayer.hidden_norm.weight"])])
    v = W["midlayer.self_attn.v_proj.weight"] @ x  # (kv heads * d): each kv head serves 2 heads
    d = HIDDEN // 4
    v_heads = np.repeat(v.reshape(2, d), 2, axis=0).reshape(-1)
    h = hidden + W["midlayer.self_attn.o_proj.weight"] @ v_heads
    z = _rms(h, W["midlayer.post_attention_layernorm.weight"])
    gate, up = W["midlayer.mlp.gate_proj.weight"] @ z, W["midlayer.mlp.up_proj.weight"] @ z
    h = h + W["midlayer.mlp.down_proj.weight"] @ (gate / (1 + np.exp(-gate)) * up)
    draft = W["lm_head.weight"] @ _rms(h, W["norm.weight"])
    full = np.full(embed.shape[0], -np.inf)
    ids = np.arange(len(draft)) + weights["d2t"]
    full[ids] = draft
    return full


def test_tapped_forward_gives_the_models_logits_and_its_layer_inputs():
    model = tiny_llama(0, layers=LAYERS, vocab=64, hidden=HIDDEN)
    tokens = mx.array([[3, 9, 1, 4, 4, 7]])
    logits, features = tapped_forward(model, tokens, None, TAPS)
    assert mx.allclose(logits, model(tokens), atol=1e-5).item()
    embed = model.model.embed_tokens(tokens)
    assert mx.array_equal(features[..., :HIDDEN], embed).item()  # tap 0: the embedding
    h = embed
    for layer in model.model.layers:
        h = layer(h, "causal")
    assert mx.allclose(features[..., 2 * HIDDEN:], h, atol=1e-5).item()  # tap 4: last output


def test_published_head_with_d2t_loads_and_drafts_as_the_reference(tmp_path):
    vocab, draft_ids = 64, [0, 2, 3, 5, 8, 13, 21, 34, 40, 55]
    model = tiny_llama(0, layers=LAYERS, vocab=vocab, hidden=HIDDEN)
    weights = write_published_head(tmp_path / "head", vocab, draft_ids)
    head = load_head(tmp_path / "head", model, ToyTokenizer(vocab))
    assert head.draft_ids().tolist() == draft_ids
    drafter = FeatureDrafter(head, model, vocab_size=vocab)
    features = np.random.default_rng(0).standard_normal(3 * HIDDEN)
    out = head.step(mx.array([[7]]), mx.array(features[None, None], mx.float32),
                    [make_cache(model)[0]], features=True)
    got = np.array(drafter._full_logits(head.logits(out[0])), np.float64)[0]
    embed = np.array(model.model.embed_tokens.weight, np.float64)
    want = reference_first_logits(weights, embed, features, 7)
    off = ~np.isin(np.arange(vocab), draft_ids)
    assert np.all(np.isneginf(got[off]))  # q = 0 off the draft vocabulary
    np.testing.assert_allclose(got[~off], want[~off], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("change, error, words", [
    ({"hidden_size": HIDDEN, "target_hidden_size": 48}, UnsupportedModelError, "width"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}, UnsupportedModelError,
     "taps"),
    ({"vocab_size": 65}, TokenizerMismatchError, "vocabulary"),
    ({"mlxspec": {"tokenizer_sha256": "0" * 64}}, TokenizerMismatchError, "tokenizer"),
    ({"num_hidden_layers": 2}, UnsupportedModelError, "layers"),
    ({"intermediate_size": 96}, CorruptModelError, "mlp"),
])
def test_a_head_that_does_not_fit_the_target_is_refused_in_one_line(tmp_path, change, error,
                                                                    words):
    vocab, draft_ids = 64, list(range(0, 64, 4))
    model = tiny_llama(0, layers=LAYERS, vocab=vocab, hidden=HIDDEN)
    write_published_head(tmp_path / "head", vocab, draft_ids, **change)
    with pytest.raises(error) as caught:
        load_head(tmp_path / "head", model, ToyTokenizer(vocab))
    message = str(caught.value)
    assert "\n" not in message and words in message


def test_a_damaged_head_file_is_refused_in_one_line(tmp_path):
    model = tiny_llama(0, layers=LAYERS, vocab=64, hidden=HIDDEN)
    write_published_head(tmp_path / "head", 64, list(range(16)))
    data = (tmp_path / "head" / "model.safetensors").read_bytes()
    (tmp_path / "head" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModelError) as caught:
        load_head(tmp_path / "head", model, ToyTokenizer(64))
    assert "\n" not in str(caught.value)


def test_a_missing_head_is_one_error_line_naming_the_choices(tmp_path):
    model = tiny_llama(0, layers=LAYERS, vocab=64, hidden=HIDDEN)
    with pytest.raises(ModelNotFoundError) as caught:
        load_head(tmp_path / "no-such-head", model, ToyTokenizer(64))
    assert "\n" not in str(caught.value) and "'auto'" in str(caught.value)


def _drafter(tmp_path, model, vocab, draft_ids):
    write_published_head(tmp_path / "head", vocab, draft_ids)
    return FeatureDrafter(load_head(tmp_path / "head", model, ToyTokenizer(vocab)), model,
                          vocab_size=vocab)


def test_a_catch_up_the_first_draft_step_takes_in_is_not_charged_twice(tmp_path):
    """Up to CATCH_UP_IN_STEP positions are processed by the first draft step and measured as
    drafting (``propose`` reports ``caught_up=1``): ``unseen`` must not also ask the planner to
    charge them as a catch-up."""
    from mlxspec.speculative.drafters import CATCH_UP_IN_STEP

    vocab = 64
    model = tiny_llama(1, layers=LAYERS, vocab=vocab, hidden=HIDDEN)
    drafter = _drafter(tmp_path, model, vocab, list(range(0, vocab, 2)))
    drafter.begin(list(range(CATCH_UP_IN_STEP + 1)))  # CATCH_UP_IN_STEP positions to process
    assert drafter.unseen() == 0
    drafter.begin(list(range(CATCH_UP_IN_STEP + 2)))
    assert drafter.unseen() == CATCH_UP_IN_STEP + 1
    assert drafter.propose(2, SamplingParams(temp=0.0)).caught_up == CATCH_UP_IN_STEP + 1


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_feature_draft_equals_plain_greedy_over_200_tokens(tmp_path, k):
    vocab = 64
    model = tiny_llama(1, layers=LAYERS, vocab=vocab, hidden=HIDDEN)
    drafter = _drafter(tmp_path, model, vocab, list(range(0, vocab, 2)))
    prompt = [5, 9, 2, 7, 1]
    stats = SpecStats()
    assert spec_tokens(model, drafter, prompt, 220, k=k, stats=stats) == \
        plain_tokens(model, prompt, 220)
    if k != "auto":
        assert stats.drafted > 0
    # A second generation on the same drafter (its cache rolled back to the shared prefix).
    assert spec_tokens(model, drafter, prompt + [3], 50, k=2) == plain_tokens(model, prompt + [3], 50)


def test_a_cached_prefix_gets_its_features_computed_again_and_decoding_stays_exact(tmp_path):
    """A chat's earlier turn or a server's stream leaving the batch: the target's cache holds
    positions no verifying pass of the drafter saw. Their features are the target's own (one
    forward), not zeros, and the output is still plain greedy's."""
    vocab = 64
    model = tiny_llama(1, layers=LAYERS, vocab=vocab, hidden=HIDDEN)
    drafter = _drafter(tmp_path, model, vocab, list(range(0, vocab, 2)))
    prompt = [int(t) for t in np.random.default_rng(4).integers(1, vocab, 30)]
    drafter.prefix = prompt[:20]
    drafter.begin(prompt)
    want = tapped_forward(model, mx.array(prompt[:20])[None], None, TAPS)[1][0]
    got = drafter.target.take(0, 20, drafter.width)
    assert mx.allclose(got, want, atol=1e-5).item()
    drafter.reset()
    cache = make_cache(model)
    mx.eval(model(mx.array(prompt[:20])[None], cache=cache))  # cached without the drafter
    drafter.prefix = prompt[:20]
    assert spec_tokens(model, drafter, prompt[20:], 60, k=3, cache=cache) == \
        plain_tokens(model, prompt, 60)


VOCAB = 8
@pytest.mark.parametrize("with_processors", [True, False])
def test_feature_draft_sampling_keeps_plain_samplings_joint_distribution(tmp_path, with_processors):
    # The draft vocabulary leaves out tokens the target samples (4, 6): they have q = 0. Without
    # processors the draft draws over its own vocabulary and reports q over the target's.
    target = tiny_llama(2, layers=LAYERS, vocab=VOCAB, scale=2.5, hidden=HIDDEN)
    drafter = _drafter(tmp_path, target, VOCAB, [0, 1, 2, 3, 5, 7])
    exact = exact_joint(target, 3, processors=with_processors)
    processors = make_logits_processors(BIAS, PENALTY) if with_processors else None
    stats, counts, runs = SpecStats(), {}, 1200
    mx.random.seed(0)
    for _ in range(runs):
        steps = speculative_generate_step(
            mx.array(PROMPT), target, drafter, sampling=SAMPLING, max_tokens=3,
            prompt_cache=make_cache(target), logits_processors=processors, num_draft_tokens=2,
            stats=stats)
        seq = tuple(t for t, _, _ in steps)
        counts[seq] = counts.get(seq, 0) + 1
    assert stats.accepted > 0 and stats.accepted < stats.drafted
    assert set(counts) <= set(exact)
    cells = sorted(exact, key=exact.get, reverse=True)
    frequent = [c for c in cells if exact[c] * runs >= 5]
    rare = [c for c in cells if exact[c] * runs < 5]
    observed = [counts.get(c, 0) for c in frequent] + [sum(counts.get(c, 0) for c in rare)]
    expected = [exact[c] * runs for c in frequent] + [sum(exact[c] for c in rare) * runs]
    assert chi_square_pvalue(np.array(observed), np.array(expected)) > 1e-4
    assert any(4 in c or 6 in c for c in counts)  # tokens the draft cannot propose still come


def test_feature_draft_with_prompt_lookup_stays_exact_and_uses_both(tmp_path):
    """The combined drafter: lookup's run where the context repeats, the head's elsewhere;
    greedy output token for token plain greedy's."""
    from mlxspec.speculative.combined import CombinedDrafter
    from mlxspec.speculative.drafters import PromptLookupDrafter

    vocab = 64
    model = tiny_llama(1, layers=LAYERS, vocab=vocab, hidden=HIDDEN)
    feature = _drafter(tmp_path, model, vocab, list(range(0, vocab, 2)))
    drafter = CombinedDrafter(feature, PromptLookupDrafter(ngram_max=3))
    proposed = record_proposals(feature)
    prompt = [5, 9, 2, 7, 1, 5, 9, 2, 7, 1, 5, 9]
    stats = SpecStats()
    assert spec_tokens(model, drafter, prompt, 120, k=3, stats=stats) == \
        plain_tokens(model, prompt, 120)
    assert drafter.from_lookup > 0 and proposed  # both drafted
    assert stats.target_passes < 120


def test_with_auto_k_lookup_drafts_through_a_pause_of_the_head(tmp_path):
    """Each drafter of the pair has its own planner: with the head paused for the whole answer,
    the plain stretches end where lookup's copy can start, lookup drafts, the head never does,
    and the greedy output is still plain greedy's."""
    from mlxspec.speculative.combined import CombinedDrafter
    from mlxspec.speculative.drafters import PromptLookupDrafter

    vocab = 64
    model = tiny_llama(1, layers=LAYERS, vocab=vocab, hidden=HIDDEN)
    feature = _drafter(tmp_path, model, vocab, list(range(0, vocab, 2)))
    drafter = CombinedDrafter(feature, PromptLookupDrafter(ngram_max=3))
    # a plain pass 10 ms, each verified draft 1 ms more: lookup's planner is ready at once
    drafter.pass_costs.verify.update({0: deque([0.010] * 4), 2: deque([0.012] * 4)})
    make = drafter.planner

    def head_paused(num_draft_tokens, sampling):
        planner = make(num_draft_tokens, sampling)
        planner.head.paused = 1000
        return planner

    drafter.planner = head_paused
    proposed = record_proposals(feature)
    prompt = [5, 9, 2, 7, 1, 3]  # no repeat: the head's turn first
    stats = SpecStats()
    assert spec_tokens(model, drafter, prompt, 120, k="auto", stats=stats) == \
        plain_tokens(model, prompt, 120)
    assert drafter.from_lookup > 0 and stats.plain_passes > 0 and not proposed


def test_a_plain_stretch_stops_after_the_step_queued_when_asked():
    """``_plain_steps``' ``stop``: the step already queued is the last (its forward put the token
    before it into the cache); tokens and cache as plain decoding's."""
    from mlxspec.cache import cache_offset
    from mlxspec.speculative.loop import _plain_steps

    model = tiny_llama(1, layers=LAYERS, vocab=64, hidden=HIDDEN)
    prompt = [5, 9, 2, 7, 1]
    cache = make_cache(model)
    mx.eval(model(mx.array(prompt[:-1])[None], cache=cache))
    seen = []
    steps = _plain_steps(model, cache, mx.array(prompt[-1:], mx.uint32), None, None,
                         SamplingParams().sampler(), 20, stop=lambda: len(seen) == 3)
    for token, _ in steps:
        seen.append(token.item())
    assert seen == plain_tokens(model, prompt, 4)
    assert cache_offset(cache) == len(prompt) + 3  # the last token stays out, as ever


def test_the_catch_up_prior_is_a_positions_cost_not_a_forwards(tmp_path, monkeypatch):
    """A head forward costs a fixed part (a draft step's) plus a little per position: the prior
    the planner charges per caught-up position is the latter. Timed on a clock that a forward
    over n positions advances by 4 ms + 0.1 ms * n (the fixed part over 8 positions alone made
    a position seem 6x dearer)."""
    from mlxspec.speculative import eagle3, feature

    vocab = 64
    model = tiny_llama(1, layers=LAYERS, vocab=vocab, hidden=HIDDEN)
    write_published_head(tmp_path / "head", vocab, list(range(0, vocab, 2)))
    head = load_head(tmp_path / "head", model, ToyTokenizer(vocab))
    clock = [0.0]
    step = eagle3.Eagle3Head.step

    def timed_step(self, tokens, *args, **kwargs):
        clock[0] += 0.004 + 0.0001 * tokens.shape[1]
        return step(self, tokens, *args, **kwargs)

    monkeypatch.setattr(eagle3.Eagle3Head, "step", timed_step)
    monkeypatch.setattr(feature.time, "perf_counter", lambda: clock[0])
    drafter = FeatureDrafter(head, model, vocab_size=vocab)
    assert drafter.catch_up_seconds == pytest.approx(0.0001)
    assert drafter.step_seconds == pytest.approx(0.0041)
