"""The built-in evaluation by domain: held-out prose, code, chat and technical text.

A quantizer fits the text it calibrates on, so a model is judged on several kinds of text, none of
them from a calibration source (``data/PROVENANCE.md``; ``tests/evaluation/test_domains.py``
checks that no passage is shared):

- ``prose``: Jane Austen's *Persuasion* (``eval.txt``), the King James Bible's *Luke* and
  Ambrose Bierce's *The Devil's Dictionary*, letters S-Z (``eval_prose.txt``);
- ``code``: other modules of Python's standard library than the calibration set's;
- ``technical``: the other half of Python's language reference topics;
- ``chat``: conversations on held-out prompts (``eval_prompts.txt``; the answers are
  SmolLM2-135M-Instruct's, ``eval_chat.jsonl``), rendered with the evaluated model's own chat
  template (left out for a model without one).

Each domain's windows are spread evenly over its token stream. The quality gate judges the worst
domain (:func:`mlxspec.evaluation.gate.gate`), not the average.
"""

from __future__ import annotations

import json

from mlxspec.errors import EvaluationError
from mlxspec.evaluation.windows import DEFAULT_WINDOW_TOKENS, check_window_args
from mlxspec.quant.calibration_set import conversation_tokens, data_text, spread_windows

DOMAIN_SOURCES: dict[str, tuple[str, ...]] = {
    "prose": ("eval.txt", "eval_prose.txt"),
    "code": ("eval_code.txt",),
    "chat": ("eval_chat.jsonl",),
    "technical": ("eval_technical.txt",),
}
DEFAULT_DOMAIN_WINDOWS = 4  # windows per domain
BUILTIN_DOMAINS_TITLE = "built-in held-out text by domain (prose, code, chat, technical)"


def conversations(name: str = "eval_chat.jsonl") -> list[list[dict[str, str]]]:
    """The held-out conversations: lists of ``{"role", "content"}`` messages."""
    return [json.loads(line)["messages"] for line in data_text(name).splitlines() if line]


def domain_ids(tokenizer, domain: str) -> list[int]:
    """The token stream of one domain (plain text tokens, no BOS; chat through the template)."""
    if domain == "chat":
        return conversation_tokens(tokenizer, conversations())
    text = "\n\n".join(data_text(name) for name in DOMAIN_SOURCES[domain])
    return list(tokenizer.encode(text, add_special_tokens=False))


def domain_windows(
    tokenizer, windows: int = DEFAULT_DOMAIN_WINDOWS, window_tokens: int = DEFAULT_WINDOW_TOKENS
) -> dict[str, list[list[int]]]:
    """``windows`` windows of ``window_tokens`` tokens per domain, evenly spread over each.

    Returns:
        ``{"prose": [...], "code": [...], "chat": [...], "technical": [...]}``; ``chat`` only
        for a tokenizer with a chat template.

    Raises:
        EvaluationError: a domain's text holds fewer than ``windows`` windows.
    """
    check_window_args(windows, window_tokens)
    out = {}
    for domain in DOMAIN_SOURCES:
        if domain == "chat" and not getattr(tokenizer, "chat_template", None):
            continue
        ids = domain_ids(tokenizer, domain)
        if len(ids) // window_tokens < windows:
            raise EvaluationError(
                f"the built-in {domain} text holds {len(ids) // window_tokens} windows of "
                f"{window_tokens} tokens, not {windows}: ask for fewer or shorter windows, or "
                "pass --text FILE")
        out[domain] = spread_windows(ids, windows, window_tokens)
    return out
