"""The shipped EAGLE-3 head on the default model (SmolLM2-135M-Instruct): found by
``--draft auto``, and greedy speculative output token for token plain greedy decoding's."""

from __future__ import annotations

import mlx.core as mx
import pytest
from speculative_helpers import plain_tokens, second_request_while_speculating, spec_tokens

from mlxspec.chat_template import chat_prompt
from mlxspec.speculative import SpecStats
from mlxspec.speculative.heads import (
    make_feature_drafter,
    pack_head,
    quantize_head,
    shipped_head_for,
)


@pytest.mark.slow
def test_shipped_head_drafts_losslessly_for_the_default_model_over_200_tokens(smollm2):
    model, tokenizer = smollm2
    assert shipped_head_for(model, tokenizer) is not None
    drafter = make_feature_drafter("auto", model, tokenizer)
    prompt = chat_prompt(tokenizer, [{"role": "user", "content":
                                      "Explain how a refrigerator works, step by step."}])
    stats = SpecStats()
    assert spec_tokens(model, drafter, prompt, 220, k=3, stats=stats) == \
        plain_tokens(model, prompt, 220)
    assert stats.accepted > 0  # the head is not a no-op: some drafts are kept


ANSWER = (" A refrigerator keeps food cold by moving heat from inside the cabinet to the room."
          " 1. The compressor squeezes the refrigerant gas, which heats it up. 2. The hot gas"
          " flows through the condenser coils at the back, where it gives its heat to the room"
          " and turns into a liquid. 3. The liquid passes through an expansion valve, its"
          " pressure drops and it cools down. 4. In the evaporator coils inside, it absorbs heat"
          " from the food and the air, and boils back into a gas. 5. The gas returns to the"
          " compressor, and the cycle starts again.")


def first_draft_hits(head, model, ids: list[int], answer_from: int) -> float:
    """How often the head's first draft is the target's own greedy next token, teacher-forced
    over ids[answer_from:] (entry p reads the target's features at p and token p + 1)."""
    from mlx_lm.models.cache import KVCache

    from mlxspec.speculative.feature import tapped_forward

    logits, features = tapped_forward(model, mx.array([ids]), None, head.config.taps)
    target = mx.argmax(logits[0], axis=-1)  # position p + 1's greedy next token
    out = head.logits(head.step(mx.array([ids[1:]]), features[:, :-1], [KVCache()],
                                features=True))[0]
    drafts = head.draft_ids()[mx.argmax(out, axis=-1)]  # entry p's guess for token p + 2
    n = len(ids)
    return (drafts[answer_from - 2: n - 2] == target[answer_from - 1: n - 1]).mean().item()


@pytest.mark.slow
def test_8_bit_head_drafts_as_well_as_in_float(smollm2):
    """The head a quantized target gets (8-bit linear layers: cheaper draft steps) hits the
    target's greedy token about as often as the float head."""
    import mlx.nn as nn

    from mlxspec.speculative.eagle3 import load_head

    model, tokenizer = smollm2
    path = shipped_head_for(model, tokenizer)
    float_head, head = load_head(path, model, tokenizer), load_head(path, model, tokenizer)
    pack_head(head)
    assert isinstance(head.lm_head, nn.QuantizedLinear) and head.lm_head.bits == 8
    prompt = chat_prompt(tokenizer, [{"role": "user", "content":
                                      "Explain how a refrigerator works, step by step."}])
    ids = prompt + tokenizer.encode(ANSWER, add_special_tokens=False)
    float_hits = first_draft_hits(float_head, model, ids, len(prompt))
    hits = first_draft_hits(head, model, ids, len(prompt))
    assert float_hits > 0.2  # the head predicts (a random one: ~0)
    assert hits >= float_hits - 0.04


def test_head_is_packed_for_a_quantized_target_only():
    import mlx.nn as nn
    from llama_toys import tiny_llama

    from mlxspec.speculative.eagle3 import Eagle3Config, Eagle3Head

    config = Eagle3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=64, draft_vocab_size=64,
                          target_hidden_size=64)
    for quantized in (False, True):
        model = tiny_llama(0, vocab=64)
        if quantized:
            nn.quantize(model, group_size=64, bits=4)
        head = Eagle3Head(config, model.model.embed_tokens)
        assert quantize_head(head, model) is quantized
        assert isinstance(head.lm_head, nn.QuantizedLinear) is quantized
        assert (head.midlayer.mlp.down_proj.bits == 8) if quantized else head.dtype == mx.float32


def test_auto_finds_no_head_for_another_model():
    from llama_toys import tiny_llama

    class Tokenizer:
        bos_token_id = pad_token_id = None
        eos_token_id, eos_token_ids = 0, [0]

        def get_vocab(self):
            return {f"t{i}": i for i in range(64)}

    assert make_feature_drafter("auto", tiny_llama(0, vocab=64), Tokenizer()) is None


@pytest.mark.slow
def test_served_lone_stream_drafts_with_the_head_and_yields_to_the_batch_exactly(smollm2):
    """``serve --draft auto``: the lone stream leaves the batch and speculates with the shipped
    head (whose features of the batch-decoded context are computed again, not zeros), a second
    request sends it back to the batch, and both texts are plain greedy decoding's."""
    from mlx_lm import stream_generate

    from mlxspec.serving.engine import Engine
    from mlxspec.serving.requests import Request
    from mlxspec.speculative import FeatureDraft, make_draft

    model, tokenizer = smollm2

    def reference(prompt, n):
        return "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=n))

    prompt_a = chat_prompt(tokenizer, [{"role": "user", "content": "List three uses of salt."}])
    prompt_b = tokenizer.encode("The capital of France is")
    draft = make_draft(model, tokenizer, draft_model=FeatureDraft("auto"))
    engine = Engine(model, tokenizer, draft=draft, num_draft_tokens=3)
    texts = second_request_while_speculating(engine, Request(prompt_a, max_tokens=48),
                                             Request(prompt_b, max_tokens=4), after=12)
    assert texts == {"first": reference(prompt_a, 48), "second": reference(prompt_b, 4)}
    head = draft.feature  # the head, paired with prompt lookup
    assert head.target.features is not None and head.cached > len(prompt_a)
