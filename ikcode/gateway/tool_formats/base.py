"""What a tool-call format is: how tools, past calls and results are written into the prompt, and
a parser that turns the model's streamed text back into text pieces and tool calls.

The parser's events carry a call's arguments in pieces (`ToolArgsDelta`) whose concatenation is
exactly `json.dumps(ToolCallEnd.input)`, so the gateway can forward them as input_json_delta
events while the call is still being generated and the client's reassembled JSON equals the input
the gateway records.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

_ID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def new_tool_use_id() -> str:
    return "toolu_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def dumps(value: Any) -> str:
    """JSON as chat templates write it (transformers' `tojson`: ", " and ": ", no ASCII escaping)."""
    return json.dumps(value, ensure_ascii=False)


_NOT_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def json_safe(value: Any) -> Any:
    """A parsed argument as strict JSON can carry it to the client: what it has no word for
    (NaN and the infinities json.loads accepts, a lone surrogate from a "\\ud83d" escape, the
    bytes or complex numbers a literal_eval gives) becomes text. Else the streamed
    input_json_delta would not parse, and a whole answer would not serialize at all (a 500)."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else _NOT_FINITE[repr(value)]
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:  # lone surrogates
            return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {json_safe(str(k)): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


# -- parser events --------------------------------------------------------------------------------
@dataclass
class TextPiece:
    text: str


@dataclass
class ToolCallStart:
    id: str
    name: str


@dataclass
class ToolArgsDelta:
    partial_json: str


@dataclass
class ToolCallEnd:
    input: dict[str, Any]


ParseEvent = TextPiece | ToolCallStart | ToolArgsDelta | ToolCallEnd


class StreamParser(Protocol):
    def feed(self, text: str) -> list[ParseEvent]: ...

    def finish(self) -> list[ParseEvent]:
        """The end of the reply: flush held text, close or drop an unfinished call."""
        ...


class TextOnlyParser:
    """The parser of a reply that may call no tool (none listed, or tool_choice "none"): what the
    model writes stays text, call markers included."""

    def feed(self, text: str) -> list[ParseEvent]:
        return [TextPiece(text)] if text else []

    def finish(self) -> list[ParseEvent]:
        return []


# -- what the renderer hands a format -------------------------------------------------------------
@dataclass
class CallItem:
    id: str
    name: str
    input: dict[str, Any]


@dataclass
class ResultItem:
    tool_use_id: str
    name: str  # the called tool's name ("" when the call is not in the conversation)
    content: str
    is_error: bool


AssistantItem = tuple[str, Any]  # ("text", str) | ("thinking", str) | ("call", CallItem)
UserItem = tuple[str, Any]  # ("text", str) | ("result", ResultItem)


@dataclass(frozen=True)
class TurnMarkers:
    """Role markers of a turn that holds tool results, when the template gives them their own."""

    prefix: str
    suffix: str


class ToolFormat:
    """The Hermes behaviour by default; each format overrides what its template does differently."""

    name = "base"
    # Strings that some vocabularies hold as single tokens: kept whole when rendering text.
    markers: tuple[str, ...] = ()
    text_joiner = "\n"  # between a user turn's text blocks (user_text)
    # The tool list goes before the turn it belongs to (Mistral's [AVAILABLE_TOOLS] before
    # [INST]) where a template has no system turn (folded_head.py)
    tools_before_turns = False
    # End-of-message tokens that also close messages inside a turn (reasoning, a call's header):
    # not stop tokens, whatever the template's turns end with.
    ends_messages_not_turns: tuple[str, ...] = ()

    def tools_text(self, tools: list[Any]) -> str:
        """The text that describes the callable tools, appended to the system turn."""
        raise NotImplementedError

    def call_text(self, call: CallItem) -> str:
        raise NotImplementedError

    def result_text(self, result: ResultItem) -> str:
        raise NotImplementedError

    def assistant_text(self, items: list[AssistantItem]) -> str:
        parts = []
        for kind, value in items:
            if kind == "text":
                parts.append(value)
            elif kind == "thinking":
                parts.append(f"<think>\n{value}\n</think>")
            else:
                parts.append(self.call_text(value))
        return "\n".join(parts)

    def user_text(self, items: list[UserItem]) -> str:
        return "\n".join(value if kind == "text" else self.result_text(value) for kind, value in items)

    def result_turns(self, results: list[ResultItem]) -> list[tuple[TurnMarkers, str]] | None:
        """Turns of their own for consecutive tool results, when the template does not put them
        in a user turn: (markers, body) each. None: they go in the user turn (user_text)."""
        return None

    def system_prefix(self, prefix: str) -> str:
        """The system turn's opening (role markers) when there are tools."""
        return prefix

    def system_text(self, system: str, tools_text: str) -> str:
        """The system turn's text with the tool list."""
        return f"{system}\n\n{tools_text}" if system else tools_text

    def new_parser(self, tools: list[Any]) -> StreamParser:
        raise NotImplementedError


def callable_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Tools as OpenAI-style function dicts (what chat templates iterate), server tools left out."""
    out = []
    for tool in tools:
        schema = getattr(tool, "input_schema", None)
        if schema is None:  # server tools (web search...) are not callable here
            continue
        function = {
            "name": tool.name,
            "description": getattr(tool, "description", None) or "",
            "parameters": schema,
        }
        out.append({"type": "function", "function": function})
    return out


def choice_text(tool_choice: Any) -> str:
    """tool_choice as one instruction after the tool list (no template has a slot for it)."""
    choice = getattr(tool_choice, "type", None)
    if choice == "any":
        return "You must call at least one function."
    if choice == "tool" and getattr(tool_choice, "name", None):
        return f"You must call the function {tool_choice.name}."
    if choice == "none":
        return "Do not call any function now; answer in text."
    return ""
