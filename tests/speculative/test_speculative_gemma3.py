"""Speculative decoding on Gemma-3-270M: exact past its sliding window, and a draft with
another tokenizer refused (in Python and in one line from the CLI)."""

from __future__ import annotations

import pytest
from speculative_helpers import plain_tokens, spec_tokens

from mlxspec.errors import TokenizerMismatchError
from mlxspec.speculative import (
    PromptLookupDrafter,
    SpecStats,
    make_drafter,
)


@pytest.fixture(scope="module")
def gemma(gemma3):
    return gemma3


@pytest.mark.slow
def test_gemma3_greedy_speculative_equals_plain_past_its_sliding_window(gemma):
    """Gemma-3's sliding-window layers (512 tokens) roll back exactly after the window wraps."""
    model, tokenizer = gemma
    steps, prompt = [], []
    while len(prompt) < 470:  # the 64 generated tokens cross the 512-token window
        steps.append(f"Step {len(steps)}: add {len(steps)} to the total and write it down.")
        prompt = tokenizer.encode(" ".join(steps))
    assert len(prompt) < 500
    expected = plain_tokens(model, prompt, 64)
    stats = SpecStats()  # prompt lookup: the prompt repeats itself, so drafts are often kept
    assert spec_tokens(model, PromptLookupDrafter(), prompt, 64, 4, stats=stats) == expected
    assert 0 < stats.accepted < stats.drafted  # acceptances and rollbacks past the window


@pytest.mark.slow
def test_a_draft_with_another_tokenizer_is_refused(gemma, smollm2):
    model, tokenizer = gemma
    draft, draft_tokenizer = smollm2
    with pytest.raises(TokenizerMismatchError, match="token id 0"):
        make_drafter(tokenizer, model, draft_model=draft, draft_tokenizer=draft_tokenizer)


@pytest.mark.slow
def test_cli_refuses_a_draft_with_another_tokenizer_in_one_line(gemma3_gguf, smollm2_dir):
    from click.testing import CliRunner

    from mlxspec.cli.main import cli

    result = CliRunner().invoke(cli, ["generate", "-m", str(gemma3_gguf), "--draft-model",
                                      str(smollm2_dir), "-p", "Hello", "--max-tokens", "2"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "tokenizer" in lines[0], lines
