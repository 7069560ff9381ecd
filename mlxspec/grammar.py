"""Constrained decoding: JSON schemas and tool-call formats as logits processors (llguidance).

A ``GrammarProcessor`` is an mlx-lm logits processor, ``(tokens (n,), logits (1, vocab)) ->
logits``, that sets the logit of every token the grammar does not allow next to ``-inf``. Its
matcher's state is a function of the token history it is shown: each call finds the common prefix
of the tokens the matcher has consumed and the generated tokens in the history, rolls the matcher
back to it and consumes the rest. The same object therefore works in plain decoding (mlx-lm's
``generate_step``), in the batch (one processor per row) and in speculative decoding, where the
drafter and the target's verification rows show it histories that branch off each other: the
drafts a pass rejects are rolled back on the next call. Masking both the draft's and the target's
distributions keeps verification exact: it verifies against the distribution plain constrained
decoding samples from. ``valid_prefix`` cuts a deterministic proposal (prompt lookup) at its first
token the grammar refuses, so such drafts are never verified.

llguidance (not outlines-core or xgrammar) because it compiles a schema lazily (about a millisecond,
where outlines-core builds its whole index per schema first), matches any JSON (``json_object`` is
recursive; a regular expression is not), rolls back any number of tokens, and needs nothing but
itself (xgrammar imports torch). The measurements are in docs/server-api.md.
"""

from __future__ import annotations

import copy
import json
import time
import weakref
from typing import Any

import mlx.core as mx
import numpy as np

from mlxspec.errors import InvalidArgumentError, UnsupportedModelError

# Compact JSON as ``json.dumps`` writes it: no free whitespace for a small model to loop in.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _llguidance():
    import llguidance  # a dependency, imported on first use (`import mlxspec` stays cheap)
    import llguidance.hf

    return llguidance


def grammar_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of ``tokenizer`` (an mlx-lm ``TokenizerWrapper``), built once per
    tokenizer (about half a second for a 49k vocabulary).

    Raises:
        UnsupportedModelError: not a fast (``tokenizers``-backed) Hugging Face tokenizer.
    """
    if tokenizer in _TOKENIZERS:
        return _TOKENIZERS[tokenizer]
    llg = _llguidance()
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        size = hf.backend_tokenizer.get_vocab_size(with_added_tokens=True)
        lltok = llg.hf.from_tokenizer(hf, n_vocab=size, eos_token=sorted(tokenizer.eos_token_ids))
    except (AttributeError, ValueError) as e:
        raise UnsupportedModelError(
            f"constrained decoding needs a fast Hugging Face tokenizer ({e})") from e
    _TOKENIZERS[tokenizer] = lltok
    return lltok


def _checked(grammar: str, what: str) -> str:
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidArgumentError(f"{what} cannot be enforced: {error.splitlines()[0]}")
    return grammar


def json_schema_grammar(schema: dict | None) -> str:
    """The grammar of JSON text valid under ``schema`` (None: any JSON object, OpenAI's
    ``json_object``).

    Raises:
        InvalidArgumentError: a schema llguidance cannot enforce (the message says why).
    """
    if schema is not None and not isinstance(schema, dict):
        raise InvalidArgumentError("a JSON schema must be a JSON object")
    schema = {"type": "object"} if schema is None else schema
    grammar = _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    return _checked(grammar, "the JSON schema")


def read_json_schema(path: str) -> dict:
    """The JSON schema in the file at ``path`` (``mlxspec generate --json-schema``).

    Raises:
        InvalidArgumentError: the file cannot be read, is not JSON, or is not a JSON object.
    """
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidArgumentError(f"cannot read the JSON schema {path}: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidArgumentError(f"the JSON schema {path} is not a JSON object")
    return schema


def schema_processor(tokenizer: Any, schema: dict | None) -> GrammarProcessor:
    """A processor that allows only JSON valid under ``schema`` (None: any JSON object)."""
    return GrammarProcessor(tokenizer, json_schema_grammar(schema))


def _literal(tokenizer: Any, text: str) -> str:
    """``text`` as a Lark terminal; a special token by its id (its bytes never match text)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and grammar_tokenizer(tokenizer).is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def tool_call_grammar(tokenizer: Any, tools: list[dict], *, name: str | None = None,
                      parallel: bool = True) -> str:
    """The grammar of tool calls in the JSON format of Hermes/Qwen templates (mlx-lm's
    ``json_tools`` parser): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
    the arguments valid under the function's ``parameters`` schema.

    Args:
        tools: OpenAI ``tools`` entries (``{"type": "function", "function": {...}}``).
        name: only this function (OpenAI's named ``tool_choice``); None: any of them.
        parallel: one or more calls (else exactly one).
    """
    calls = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        calls.append({"type": "object", "additionalProperties": False,
                      "required": ["name", "arguments"],
                      "properties": {"name": {"const": function["name"]},
                                     "arguments": function.get("parameters") or {"type": "object"}}})
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    start = _literal(tokenizer, tokenizer.tool_call_start)
    end = _literal(tokenizer, tokenizer.tool_call_end)
    more = ' ("\\n" call)*' if parallel else ""
    lark = "\n".join([f"start: call{more}", f'call: {start} "\\n" body "\\n" {end}',
                      f"body: %json {json.dumps(schema)}", ""])
    return _checked(_llguidance().LLMatcher.grammar_from_lark(lark), "tool_choice")


class _MatcherState:
    """A matcher and the generated tokens it has consumed (shared by a processor's views)."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher = matcher
        self.consumed: list[int] = []
        self.bitmask = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)
        self.vocab_size = vocab_size
        self.masks = 0  # masks computed, and the seconds they took (bench/serve.py reports both)
        self.mask_seconds = 0.0


class GrammarProcessor:
    """A logits processor that allows only the tokens ``grammar`` allows next (module docstring).

    Args:
        tokenizer: the model's tokenizer (mlx-lm ``TokenizerWrapper``).
        grammar: from ``json_schema_grammar`` or ``tool_call_grammar``.
        start: where generated tokens begin in the histories this processor is shown (the prompt
            length); None: the length of the first history it is shown (every decoding loop shows
            the prompt first, to draw the first token).
    """

    def __init__(self, tokenizer: Any, grammar: str, start: int | None = None):
        lltok = grammar_tokenizer(tokenizer)
        matcher = _llguidance().LLMatcher(lltok, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidArgumentError(f"the grammar cannot be enforced: {matcher.get_error()}")
        self._state = _MatcherState(matcher, lltok.vocab_size)
        self.start = start

    def view(self, offset: int) -> GrammarProcessor:
        """The same processor (shared state) for histories that begin at position ``offset`` of
        the ones it is shown now: a stream moving from the batch to speculative decoding, whose
        cache already holds the first ``offset`` tokens."""
        other = copy.copy(self)
        other.start = None if self.start is None else self.start - offset
        return other

    @property
    def stats(self) -> tuple[int, float]:
        """(masks computed, seconds spent computing and applying them)."""
        return self._state.masks, self._state.mask_seconds

    def _sync(self, tokens: mx.array) -> bool:
        """Bring the matcher to the generated tokens of ``tokens``; False if the grammar refuses
        them (a history past a refused draft: its row is never used)."""
        if self.start is None:
            self.start = tokens.size
        state = self._state
        if self.start >= 0:
            generated = tokens[self.start:].tolist() if tokens.size > self.start else []
        else:  # the first -start generated tokens are behind the view: those already consumed
            hidden = -self.start
            if hidden > len(state.consumed):
                return False
            generated = state.consumed[:hidden] + tokens.tolist()
        consumed = state.consumed
        same = 0
        for a, b in zip(consumed, generated, strict=False):
            if a != b:
                break
            same += 1
        if same < len(consumed):
            state.matcher.rollback(len(consumed) - same)
            del consumed[same:]
        rest = generated[same:]
        if rest:
            taken = state.matcher.try_consume_tokens(rest)
            consumed.extend(rest[:taken])
            if taken < len(rest):
                return False
        return True

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """``logits`` (1, vocab) with the tokens the grammar refuses after ``tokens`` at -inf."""
        # The mask needs the newest token, not the logits: start the forward computing them now,
        # so it runs while this thread waits for that token and computes the mask.
        mx.async_eval(logits)
        if not self._sync(tokens):
            return logits
        tic = time.perf_counter()  # after the sync, which waits for the token being computed
        state = self._state
        state.matcher.unsafe_compute_mask_ptr(state.bitmask.ctypes.data, state.bitmask.nbytes)
        allowed = np.unpackbits(state.bitmask.view(np.uint8), bitorder="little")
        width = logits.shape[-1]
        allowed = allowed[: min(width, state.vocab_size)]
        if allowed.size < width:  # output rows beyond the tokenizer's vocabulary: never allowed
            allowed = np.concatenate([allowed, np.zeros(width - allowed.size, allowed.dtype)])
        masked = mx.where(mx.array(allowed.astype(bool)), logits,
                          mx.array(-float("inf"), logits.dtype))
        state.masks += 1
        state.mask_seconds += time.perf_counter() - tic
        return masked

    def valid_prefix(self, tokens: mx.array, drafts: list[int]) -> int:
        """How many of ``drafts``, proposed after ``tokens``, the grammar accepts in a row."""
        if not self._sync(tokens):
            return 0
        return self._state.matcher.validate_tokens(drafts)

    def finished(self) -> bool:
        """Whether the grammar is satisfied (the text so far is complete)."""
        return self._state.matcher.is_accepting()
