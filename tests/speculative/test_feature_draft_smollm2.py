"""The shipped EAGLE-3 head on the default model (SmolLM2-135M-Instruct): found by
``--draft auto``, and greedy speculative output token for token plain greedy decoding's."""

from __future__ import annotations

import pytest
from speculative_helpers import plain_tokens, second_request_while_speculating, spec_tokens

from mlxspec.chat import chat_prompt
from mlxspec.speculative import SpecStats
from mlxspec.speculative.heads import make_feature_drafter, shipped_head_for


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
    assert draft.target.features is not None and draft.cached > len(prompt_a)
