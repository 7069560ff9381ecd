"""The OpenAI wire format for ``mlxspec serve``: request bodies in, response objects out.

Follows mlx-lm's server (``mlx_lm.server``) so clients written for it work: the same routes, the
same fields (``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``stop``, ``seed``, ``logprobs`` / ``top_logprobs``, ``repetition_penalty``,
``logit_bias``, ``stream`` and ``stream_options.include_usage``), the same response objects;
also ``tools`` / ``tool_choice`` (``mlxspec.serving.tool_calls``) and ``response_format``
(constrained decoding, ``mlxspec.grammar``). A field outside ``CHAT_FIELDS`` / ``TEXT_FIELDS``,
or one of ``NO_OP_FIELDS`` with a value other than its no-op, is refused with a 400 naming it:
nothing a client asks for is silently ignored (docs/server-api.md lists the set).
Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlxspec.chat_template import chat_prompt
from mlxspec.errors import InvalidArgumentError
from mlxspec.generate import encode_prompt
from mlxspec.sampling import check_seed
from mlxspec.serving.engine import Event, Request
from mlxspec.serving.request_fields import ApiError, check_fields, response_grammar
from mlxspec.serving.tool_calls import (
    ToolCallStream,
    assistant_tool_calls,
    parse_tools,
)

MAX_STOP = 16  # stop strings per request
MAX_TOP_LOGPROBS = 20
ROLES = {"system", "developer", "user", "assistant", "tool"}
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id"}


@dataclass
class Limits:
    """What one request may ask for (the server's safety limits)."""

    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096
    default_max_tokens: int = 512
    max_context: int = 8192
    max_concurrent: int = 64


@dataclass
class Completion:
    """A parsed request: what to generate and how to answer."""

    kind: str  # "chat" or "text"
    request: Request
    model: str
    stream: bool = False
    include_usage: bool = False
    tool_stream: ToolCallStream | None = None  # tools offered: splits the text into calls
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if self.stream else "chat.completion"
        return "text_completion"

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ApiError(f"{name} must be a number in [{lo}, {hi}]", param=name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ApiError(f"{name} must be an integer in [{lo}, {hi}]", param=name)
    return value


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError("each message needs a string role", param="messages")
        if m["role"] not in ROLES:
            raise ApiError(f"messages[{i}].role {m['role']!r} is not one of {sorted(ROLES)}",
                           param=f"messages[{i}].role")
        unknown = sorted(set(m) - MESSAGE_FIELDS)
        if unknown:
            raise ApiError(f"messages[{i}] has unsupported fields {unknown}",
                           param=f"messages[{i}].{unknown[0]}")
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: only text is supported
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            if not all(isinstance(t, str) for t in parts) or len(parts) != len(content):
                raise ApiError("only text content parts are supported", param="messages")
            content = "".join(parts)
        if not isinstance(content, str):
            raise ApiError("message content must be a string", param="messages")
        # "developer" is OpenAI's newer name for the system role; templates know "system".
        message = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise ApiError(f"messages[{i}].{key} must be a string", param=f"messages[{i}]")
                message[key] = m[key]
        if m.get("tool_calls"):
            if m["role"] != "assistant":
                raise ApiError("only assistant messages carry tool_calls", param=f"messages[{i}]")
            try:
                message["tool_calls"] = assistant_tool_calls(m["tool_calls"])
            except InvalidArgumentError as e:
                raise ApiError(f"messages[{i}]: {e}", param=f"messages[{i}].tool_calls") from None
        out.append(message)
    return out


def _vocab_size(tokenizer: TokenizerWrapper) -> int:
    return len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else 1 << 31


def _encode(tokenizer: TokenizerWrapper, text: str, param: str) -> list[int]:
    try:
        return encode_prompt(tokenizer, text).tolist()
    except InvalidArgumentError as e:  # not valid Unicode, or no tokens at all
        raise ApiError(str(e), param=param) from None


def _prompt_ids(body: dict, kind: str, tokenizer: TokenizerWrapper,
                tools: list[dict] | None = None) -> list[int]:
    if kind == "chat":
        messages = _messages(body)
        if not getattr(tokenizer, "has_tool_calling", False) and any(
            m["role"] == "tool" or "tool_calls" in m for m in messages
        ):
            raise ApiError("this model's chat template has no tool support: it cannot take tool "
                           "calls or tool results", param="messages")
        if not tokenizer.chat_template:  # mlx-lm's plain fallback: role: content lines
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
            return _encode(tokenizer, text, "messages")
        try:
            return chat_prompt(tokenizer, messages, tools=tools)
        except Exception as e:  # the template rejected the conversation (e.g. role order)
            raise ApiError(f"the chat template rejected the messages: {e}", param="messages") from e
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return _encode(tokenizer, prompt, "prompt")
    vocab = _vocab_size(tokenizer)
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt
    ):
        return prompt
    raise ApiError("prompt must be a non-empty string or list of token ids", param="prompt")


def parse_completion(
    body: Any, kind: str, tokenizer: TokenizerWrapper, limits: Limits, model_id: str
) -> Completion:
    """Validate a ``/v1/chat/completions`` (``kind="chat"``) or ``/v1/completions`` body.

    Raises:
        ApiError: a malformed field, or a request beyond the limits (status 400).
    """
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    check_fields(body, kind)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("stream must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, None, 1, limits.max_tokens)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(
        isinstance(s, str) for s in stop
    ):
        raise ApiError(f"stop must be a string or a list of at most {MAX_STOP} strings",
                       param="stop")
    if kind == "chat":
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise ApiError("logprobs must be true or false", param="logprobs")
        top = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) if logprobs else 0
    else:
        top = _integer(body, "logprobs", None, 0, 5)
        logprobs, top = top is not None, top or 0
    bias = body.get("logit_bias")
    if bias is not None:
        try:
            bias = {int(k): float(v) for k, v in bias.items()}
        except (AttributeError, TypeError, ValueError) as e:
            raise ApiError("logit_bias must map token ids to numbers", param="logit_bias") from e
        vocab = _vocab_size(tokenizer)
        if not all(0 <= k < vocab for k in bias):
            raise ApiError(f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
    penalty = body.get("repetition_penalty")
    penalty = _number(body, "repetition_penalty", 0.0, 0.0, 10.0) if penalty else None
    seed = body.get("seed")
    try:
        check_seed(seed)
    except InvalidArgumentError as e:
        raise ApiError(str(e), param="seed") from None

    tools = parse_tools(body, tokenizer, lambda message, param: ApiError(message, param=param))
    grammar = response_grammar(body, tokenizer, tools)
    prompt = _prompt_ids(body, kind, tokenizer, tools.tools)
    room = limits.max_context - len(prompt)
    if room < 1:
        raise ApiError(f"the prompt has {len(prompt)} tokens; the context is "
                       f"{limits.max_context}: shorten the prompt", param="messages")
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, room)
    elif max_tokens > room:
        raise ApiError(f"prompt ({len(prompt)} tokens) + {name} ({max_tokens}) exceeds the "
                       f"context of {limits.max_context} tokens: lower {name}", param=name)
    request = Request(
        prompt=prompt,
        max_tokens=max_tokens,
        temp=_number(body, "temperature", 0.0, 0.0, 2.0),
        # top_p 0 means "no nucleus filter" to mlx_lm.server's clients (its sampler ignores it).
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        top_k=int(_number(body, "top_k", 0, 0, 1 << 20)),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        stop=tuple(stop),
        seed=seed,
        logprobs=logprobs,
        top_logprobs=top,
        repetition_penalty=penalty,
        logit_bias=bias,
        grammar=grammar,
    )
    model = body.get("model") if isinstance(body.get("model"), str) else model_id
    tool_stream = None
    if tools.tools:
        tool_stream = ToolCallStream(tokenizer, tools.tools, streaming=stream,
                                     parallel=tools.parallel)
    return Completion(kind, request, model, stream, bool(options.get("include_usage")),
                      tool_stream=tool_stream)


# -- responses --------------------------------------------------------------------------------


def _token_text(tokenizer: TokenizerWrapper, token: int) -> str:
    return tokenizer.decode([token])


def _logprobs(c: Completion, events: list[Event], tokenizer: TokenizerWrapper) -> Any:
    events = [e for e in events if e.logprob is not None]
    if not c.request.logprobs:
        return None
    if c.kind == "chat":
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = _token_text(tokenizer, token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [
            dict(entry(e.token, e.logprob),
                 top_logprobs=[entry(t, lp) for t, lp in e.top_logprobs or []])
            for e in events
        ]}
    return {
        "tokens": [_token_text(tokenizer, e.token) for e in events],
        "token_logprobs": [e.logprob for e in events],
        "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in e.top_logprobs or []}
                         for e in events],
    }


def usage(event: Event) -> dict[str, Any]:
    return {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.prompt_tokens + event.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": event.cached_tokens},
    }


def _envelope(c: Completion, choices: list[dict]) -> dict[str, Any]:
    return {"id": c.response_id, "object": c.object, "created": c.created, "model": c.model,
            "system_fingerprint": "mlxspec", "choices": choices}


def response_body(c: Completion, events: list[Event], tokenizer: TokenizerWrapper) -> dict:
    """The whole (non-streamed) response once the last event has arrived."""
    text, calls = _split(c, "".join(e.text for e in events), final=True)
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish_reason(c, events[-1]),
                              "logprobs": _logprobs(c, events, tokenizer)}
    if c.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            choice["message"]["tool_calls"] = calls
    else:
        choice["text"] = text
    body = _envelope(c, [choice])
    body["usage"] = usage(events[-1])
    return body


def chunk_body(c: Completion, events: list[Event], tokenizer: TokenizerWrapper,
               first: bool) -> dict:
    """One streamed chunk carrying the text of ``events`` (the last may finish the request)."""
    text, calls = _split(c, "".join(e.text for e in events),
                         final=events[-1].finish_reason is not None)
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish_reason(c, events[-1]),
                              "logprobs": _logprobs(c, events, tokenizer)}
    if c.kind == "chat":
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        if calls:
            choice["delta"]["tool_calls"] = calls
    else:
        choice["text"] = text
    return _envelope(c, [choice])


def _split(c: Completion, text: str, *, final: bool) -> tuple[str, list[dict]]:
    """The content and the tool calls in new text (all of it if ``final``)."""
    if c.tool_stream is None:
        return text, []
    content, calls = c.tool_stream.feed(text)
    if final:
        rest, more = c.tool_stream.finish()
        content, calls = content + rest, calls + more
    return content, calls


def _finish_reason(c: Completion, last: Event) -> str | None:
    made_calls = c.tool_stream is not None and c.tool_stream.made_calls
    return "tool_calls" if last.finish_reason == "stop" and made_calls else last.finish_reason


def usage_chunk(c: Completion, last: Event) -> dict:
    body = _envelope(c, [])
    body["usage"] = usage(last)
    return body


def models_body(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [
        {"id": model_id, "object": "model", "created": created, "owned_by": "mlxspec"}
    ]}
