"""A conversation rendered with the model's chat template: the one place mlxspec applies one.

Low in the package (it needs only the tokenizer), so that quantization, serving, draft training
and the benches render conversations without importing the chat session (:mod:`mlxspec.chat`).
"""

from __future__ import annotations

from typing import Any

from mlxspec.errors import UnsupportedModelError


def chat_prompt(
    tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template.

    Args:
        messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
        add_generation_prompt: end with the header of the assistant's turn.
        tools: OpenAI ``tools`` entries for a template that takes them (``mlxspec serve``).

    Raises:
        UnsupportedModelError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise UnsupportedModelError(
            "this model has no chat template: feed the prompt as raw text (--no-chat-template)"
        )
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True,
            **({"tools": tools} if tools else {}),
        )
    )
