"""Multi-turn chat that keeps the KV cache between turns.

Each turn renders the whole conversation with the model's chat template, finds the longest prefix
of it whose keys and values are already in the cache, trims the cache back to that prefix and
prefills only the rest. The reply is therefore the one a fresh prefill of the whole conversation
gives, at the cost of only the new turn's tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import common_prefix_len

from mlxspec.cache import cache_offset, make_cache, trim_cache
from mlxspec.chat_template import chat_prompt
from mlxspec.errors import MlxspecError, UnsupportedModelError
from mlxspec.generate import Response, stream_generate
from mlxspec.speculative import Drafter, make_drafter


class ChatSession:
    """A conversation with a model: messages, the KV cache, and the tokens the cache holds.

    Args:
        model, tokenizer: as returned by ``mlxspec.load``.
        system: optional system prompt.
        max_kv_size: use a rotating cache of this many tokens (bounded memory).
        generation: default keyword arguments for ``stream_generate`` (temp, max_tokens, ...).
            ``draft_model`` (+ ``draft_tokenizer``) or ``prompt_lookup`` (+ ``ngram_max``) build one
            drafter for the whole conversation: like the target's, its cache is kept across turns.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        *,
        system: str | None = None,
        max_kv_size: int | None = None,
        **generation: Any,
    ):
        if not getattr(tokenizer, "chat_template", None):
            raise UnsupportedModelError(
                "this model has no chat template: use `mlxspec generate` instead of chat"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.system = system
        self.max_kv_size = max_kv_size
        self.generation = generation
        self.draft = self._make_drafter()
        self.messages: list[dict[str, str]] = []
        self.last: Response | None = None
        self.prefilled_tokens = 0  # tokens prefilled in the last turn (the rest came from cache)
        self.reset()

    def _make_drafter(self) -> Drafter | None:
        """The speculative drafter asked for in ``generation`` (popped from it), or None."""
        draft_model = self.generation.pop("draft_model", None)
        draft_tokenizer = self.generation.pop("draft_tokenizer", None)
        prompt_lookup = self.generation.pop("prompt_lookup", False)
        ngram_max = self.generation.pop("ngram_max", 3)
        min_confidence = self.generation.pop("draft_min_confidence", 0.0)
        if draft_model is None and not prompt_lookup:
            return None
        return make_drafter(
            self.tokenizer,
            self.model,
            draft_model=draft_model,
            draft_tokenizer=draft_tokenizer,
            prompt_lookup=prompt_lookup,
            ngram_max=ngram_max,
            max_kv_size=self.max_kv_size,
            min_confidence=min_confidence,
        )

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        if self.draft is not None:
            self.draft.reset()
        self.messages = []
        self.cache = make_cache(self.model, self.max_kv_size)
        self.cached_tokens: list[int] = []

    def set_system(self, system: str | None) -> None:
        """Change the system prompt; the cache is reused up to where the conversation changed."""
        self.system = system

    def conversation_tokens(self, add_generation_prompt: bool = True) -> list[int]:
        """The whole conversation rendered with the chat template, as token ids."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return chat_prompt(
            self.tokenizer, system + self.messages, add_generation_prompt=add_generation_prompt
        )

    def _reuse_cache(self, tokens: list[int]) -> int:
        """Trim the cache to the longest cached prefix of ``tokens``; returns its length."""
        keep = min(common_prefix_len(self.cached_tokens, tokens), len(tokens) - 1)
        drop = cache_offset(self.cache) - keep
        if drop > 0 and not trim_cache(self.cache, drop):
            # e.g. a rotating cache that has wrapped: prefill again from scratch
            self.cache = make_cache(self.model, self.max_kv_size)
            keep = 0
        self.cached_tokens = tokens[:keep]
        return keep

    def stream_reply(self, user_text: str, **overrides: Any) -> Iterator[Response]:
        """Add a user turn and stream the assistant's reply.

        The reply is recorded even when the caller stops early (Ctrl-C): the conversation and the
        cache stay consistent.
        """
        self.messages.append({"role": "user", "content": user_text})
        tokens = self.conversation_tokens()
        keep = self._reuse_cache(tokens)
        self.prefilled_tokens = len(tokens) - keep
        generated: list[int] = []
        text = ""
        options = {**self.generation, **overrides}
        if self.draft is not None:
            # The drafter conditions on the whole conversation, not only the new tokens.
            self.draft.prefix = tokens[:keep]
            options.setdefault("draft", self.draft)
        try:
            for response in stream_generate(
                self.model, self.tokenizer, tokens[keep:], prompt_cache=self.cache, **options
            ):
                generated.append(response.token)
                text += response.text
                self.last = response
                yield response
        except MlxspecError:
            if not generated:  # the turn was refused before any work: as if never asked
                self.messages.pop()
            raise
        finally:
            if self.messages and self.messages[-1]["role"] == "user":
                self._record_reply(tokens, generated, text)

    def _record_reply(self, tokens: list[int], generated: list[int], text: str) -> None:
        """Record the (possibly partial) reply; the cache keeps only tokens of the conversation."""
        self.messages.append({"role": "assistant", "content": text})
        known = tokens + generated
        held = cache_offset(self.cache)
        if held > len(known) and not trim_cache(self.cache, held - len(known)):
            # interrupted between a model step and its token, past what the cache can drop
            self.cache = make_cache(self.model, self.max_kv_size)
            known = []
        self.cached_tokens = known[: cache_offset(self.cache)]

    def reply(self, user_text: str, **overrides: Any) -> str:
        """Add a user turn and return the whole reply."""
        return "".join(r.text for r in self.stream_reply(user_text, **overrides))

