"""The shipped EAGLE-3 head on the default model (SmolLM2-135M-Instruct): found by
``--draft auto``, and greedy speculative output token for token plain greedy decoding's."""

from __future__ import annotations

import pytest
from speculative_helpers import plain_tokens, spec_tokens

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
