"""What an OpenAI request may carry, and the constrained decoding its fields ask for.

``check_fields`` refuses (400, naming it) any field outside ``CHAT_FIELDS`` / ``TEXT_FIELDS`` and
any of ``NO_OP_FIELDS`` with a value other than the one that asks for nothing: nothing a client
sends is silently ignored. ``response_grammar`` turns ``response_format`` (and ``tool_choice``
"required" or a named function) into an ``mlxspec.grammar`` grammar.
"""

from __future__ import annotations

import json
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlxspec.errors import MlxspecError
from mlxspec.grammar import grammar_tokenizer, json_schema_grammar, tool_call_grammar
from mlxspec.serving.tool_calls import ToolChoice

COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "n",
    "stream", "stream_options", "logprobs", "logit_bias", "repetition_penalty",
    "response_format", "frequency_penalty", "presence_penalty", "max_completion_tokens",
    "user",  # an end-user id: metadata, no effect on the answer (as in OpenAI's API)
}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "top_logprobs", "tools",
                               "tool_choice", "parallel_tool_calls"}
TEXT_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of"}
# Fields accepted only with the value that asks for nothing (what the server does anyway).
NO_OP_FIELDS = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0, "echo": False,
                "best_of": 1}


class ApiError(Exception):
    """A request the server refuses; ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": None}}


def check_fields(body: dict, kind: str) -> None:
    allowed = CHAT_FIELDS if kind == "chat" else TEXT_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(f"unsupported parameter {unknown[0]!r} for this endpoint (mlxspec serve "
                       f"honours: {', '.join(sorted(allowed))})", param=unknown[0])
    for name, value in NO_OP_FIELDS.items():
        if body.get(name) is not None and body[name] != value:
            hint = " (use repetition_penalty)" if name.endswith("_penalty") else ""
            raise ApiError(f"only {name}={json.dumps(value)} is supported{hint}", param=name)


def response_grammar(body: dict, tokenizer: TokenizerWrapper, tools: ToolChoice) -> str | None:
    """The constrained-decoding grammar a request asks for: its response_format, or the tool
    calls that tool_choice "required" / a named function demands."""
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is not None and kind not in ("text", "json_object", "json_schema"):
        raise ApiError('response_format must be {"type": "text" | "json_object" | "json_schema"}',
                       param="response_format")
    wants_json = kind in ("json_object", "json_schema")
    try:
        if wants_json or tools.mode in ("required", "function"):
            grammar_tokenizer(tokenizer)  # built once, here: never on the engine's thread
        if tools.mode in ("required", "function"):
            if wants_json:
                raise ApiError(f"response_format {kind} and tool_choice {tools.mode} cannot both "
                               "hold", param="response_format")
            return tool_call_grammar(tokenizer, tools.tools, name=tools.name,
                                     parallel=tools.parallel)
        if not wants_json:
            return None
        if tools.tools:
            raise ApiError(f"response_format {kind} with tools: the JSON grammar would forbid "
                           "tool calls; send tool_choice none, or no response_format",
                           param="response_format")
        if kind == "json_object":
            return json_schema_grammar(None)
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ApiError('json_schema needs {"name": ..., "schema": {...}}',
                           param="response_format")
        return json_schema_grammar(spec["schema"])  # "strict": always (constrained decoding)
    except MlxspecError as e:  # a schema llguidance cannot enforce, a tokenizer it cannot read
        raise ApiError(str(e), param="response_format" if wants_json else "tool_choice") from None
