"""Tools in the OpenAI wire format: ``tools`` / ``tool_choice`` checked, and the tool calls a model
writes found in its text and returned as OpenAI ``tool_calls``.

As ``mlx_lm.server``: the tools go to the chat template; the model's tool-call format and parser
are the ones mlx-lm's tokenizer loader found for its template (``mlx_lm.tool_parsers``: the text
between ``tokenizer.tool_call_start`` and ``tool_call_end`` is handed to ``tokenizer.tool_parser``).
``tool_choice`` ``"required"`` or a named function is enforced by constrained decoding
(``mlxspec.grammar.tool_call_grammar``), for the JSON format of Hermes/Qwen templates.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from mlxspec.errors import InvalidArgumentError

log = logging.getLogger("mlxspec.serving.tool_calls")

JSON_FORMAT = "mlx_lm.tool_parsers.json_tools"  # the format tool_call_grammar writes


@dataclass
class ToolChoice:
    """What a request asked of the tools: ``tools`` for the chat template (None: not shown),
    ``mode`` (``"auto"``, ``"none"``, ``"required"`` or ``"function"``), ``name`` of a named
    function, ``parallel`` (more than one call per answer)."""

    tools: list[dict] | None
    mode: str = "none"
    name: str | None = None
    parallel: bool = True


def parse_tools(body: dict, tokenizer: Any, error: type[Exception]) -> ToolChoice:
    """Check ``tools``, ``tool_choice`` and ``parallel_tool_calls``; ``error(message, param)`` is
    raised for a bad one, and for tools on a model whose template has no tool support."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise error("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if not tools:
        if choice not in (None, "none"):
            raise error("tool_choice needs tools", "tool_choice")
        return ToolChoice(None)
    if not isinstance(tools, list) or not all(_is_function_tool(t) for t in tools):
        raise error('tools must be a list of {"type": "function", "function": {"name": ..., '
                    '"parameters": {...}}}', "tools")
    if not getattr(tokenizer, "has_tool_calling", False):
        raise error("this model's chat template has no tool support (mlx-lm finds no tool-call "
                    "format for it): send the request without tools, or serve a model whose "
                    "template takes tools", "tools")
    names = [t["function"]["name"] for t in tools]
    if choice in (None, "auto"):
        return ToolChoice(tools, "auto", parallel=parallel is not False)
    if choice == "none":  # the model is not told about the tools, and no call is parsed
        return ToolChoice(None)
    if choice == "required":
        mode, name = "required", None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
        choice.get("function"), dict
    ) and choice["function"].get("name") in names:
        mode, name = "function", choice["function"]["name"]
    else:
        raise error(f'tool_choice must be "auto", "none", "required" or {{"type": "function", '
                    f'"function": {{"name": one of {names}}}}}', "tool_choice")
    if getattr(tokenizer.tool_parser, "__module__", None) != JSON_FORMAT:
        raise error(f"tool_choice {mode!r} is enforced for the JSON tool-call format "
                    f"(<tool_call>{{...}}</tool_call>) only; this model's format is "
                    f"{tokenizer.tool_parser.__module__}: use tool_choice auto", "tool_choice")
    return ToolChoice(tools, mode, name, parallel=parallel is not False and mode == "required")


def _is_function_tool(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return (tool.get("type") == "function" and isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("parameters", {}), dict))


def assistant_tool_calls(calls: Any) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates take them (arguments parsed from
    their JSON string, as mlx-lm's server does)."""
    if not isinstance(calls, list):
        raise InvalidArgumentError("tool_calls must be a list")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidArgumentError("each tool call needs a function with a name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise InvalidArgumentError(f"tool call arguments are not JSON: {e}") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


class ToolCallStream:
    """Splits generated text into content and tool calls as it arrives.

    ``feed(text)`` returns the content that is certainly not part of a call (a possible start of
    the start marker is held back) and the calls completed so far; ``finish()`` the rest. A call
    the parser cannot read (cut off by ``max_tokens``) is returned as content, not dropped.
    """

    def __init__(self, tokenizer: Any, tools: list[dict], *, streaming: bool, parallel: bool = True):
        self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end
        self.parser, self.tools = tokenizer.tool_parser, tools
        self.streaming, self.parallel = streaming, parallel
        self.buffer, self.in_call, self.calls = "", False, 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, calls = "", []
        while True:
            if self.in_call:
                at = self.buffer.find(self.end)
                if at < 0:
                    return content, calls
                calls += self._parse(self.buffer[:at]) or []
                self.buffer, self.in_call = self.buffer[at + len(self.end):], False
                continue
            at = self.buffer.find(self.start)
            if at < 0:
                keep = _partial_suffix(self.buffer, self.start)
                content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return content, calls
            content += self.buffer[:at]
            self.buffer, self.in_call = self.buffer[at + len(self.start):], True

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        calls = self._parse(rest)
        return ("", calls) if calls is not None else (self.start + rest, [])

    @property
    def made_calls(self) -> bool:
        return self.calls > 0

    def _parse(self, text: str) -> list[dict] | None:
        try:
            parsed = self.parser(text, self.tools)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("a tool call could not be parsed (%s): %r", e, text[:200])
            return None
        calls = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if self.calls and not self.parallel:
                log.info("parallel_tool_calls is false: a further call is dropped")
                continue
            entry = {"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": call["name"],
                                  "arguments": json.dumps(call.get("arguments", {}),
                                                          ensure_ascii=False)}}
            if self.streaming:
                entry["index"] = self.calls
            self.calls += 1
            calls.append(entry)
        return calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
