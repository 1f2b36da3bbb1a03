"""Mistral: [TOOL_CALLS] then a JSON array of {"name", "arguments"} (or v11+ `name{...}`).

Markers as vLLM reads them (mistral_tool_parser.py @021235c: [TOOL_CALLS] :95, v11's `name{...}`
:99-100, 9-character call ids :50-52); tool list, call and result text as Mistral's own tool
template writes them (tests/data/chat_templates/mistral.jinja). Two departures, both for the
prefix cache: the template puts [AVAILABLE_TOOLS] before the last user message, which moves every
turn, so the list goes at the start of the prompt instead; and Mistral's 9-character call ids are
derived from the Anthropic ids (a digest), so a resent conversation renders the same.
"""

from __future__ import annotations

from hashlib import blake2b
from typing import Any

from ikcode.gateway.tool_formats.base import (
    AssistantItem,
    CallItem,
    ParseEvent,
    ResultItem,
    TextPiece,
    ToolFormat,
    TurnMarkers,
    dumps,
)
from ikcode.gateway.tool_formats.json_args import CallAssembler, JsonCallParser, ObjectScanner
from ikcode.gateway.tool_formats.tagged import TaggedCallParser

TOOL_CALLS = "[TOOL_CALLS]"
_ALPHANUMERIC = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
NO_MARKERS = TurnMarkers("", "")


def mistral_call_id(tool_use_id: str) -> str:
    digest = blake2b(tool_use_id.encode(), digest_size=9).digest()
    return "".join(_ALPHANUMERIC[b % len(_ALPHANUMERIC)] for b in digest)


class MistralCallsBody:
    """What follows [TOOL_CALLS]: `[{...}, {...}]`, or `name{...}` / `name[ARGS]{...}` (v11+)."""

    def __init__(self) -> None:
        self._mode = "start"  # start -> array | named; array -> after (text past its "]")
        self._buf = ""
        self._call: JsonCallParser | None = None
        self._named: CallAssembler | None = None
        self._scanner: ObjectScanner | None = None
        self._num_calls = 0
        self._text_after = False  # text after the calls has begun (later whitespace is its own)

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        out: list[ParseEvent] = []
        while self._buf:
            if self._mode == "start":
                stripped = self._buf.lstrip()
                marked = stripped.startswith(TOOL_CALLS)  # v11+: one marker per call
                if marked:
                    stripped = stripped[len(TOOL_CALLS) :].lstrip()
                if not stripped or TOOL_CALLS.startswith(stripped):
                    return out
                if self._num_calls and not marked:  # after the calls, no marker: the reply's text
                    self._mode = "after"
                    continue
                self._mode = "array" if stripped[0] == "[" else "named"
                self._buf = stripped[1:] if self._mode == "array" else stripped
            elif self._mode == "array":
                if self._call is None:
                    stripped = self._buf.lstrip().lstrip(",").lstrip()
                    if not stripped:
                        return out
                    if stripped[0] != "{":  # the array's "]", or whatever the model wrote instead
                        self._mode, self._buf = "after", stripped[1:] if stripped[0] == "]" else stripped
                        continue
                    self._buf, self._call = stripped, JsonCallParser()
                events, used = self._call.feed(self._buf)
                self._buf = self._buf[used:]
                out += events
                if not self._call.done:
                    return out
                out += self._end_array_call()
            elif self._mode == "after":
                # Text the model wrote after its calls is the reply's text, not lost (with no
                # call before it, close() says so and the whole body is shown as text once),
                # unless it is more calls.
                text = self._buf if self._text_after else self._buf.lstrip()
                more_calls = text.startswith(TOOL_CALLS) or TOOL_CALLS.startswith(text)
                if self._num_calls and not self._text_after and more_calls:
                    if not text.startswith(TOOL_CALLS):
                        return out  # perhaps the marker, in pieces
                    self._mode = "start"
                    continue
                if self._num_calls and text:
                    out.append(TextPiece(text))
                    self._text_after = True
                self._buf = ""
            else:
                if self._scanner is None:
                    at = self._buf.find("{")
                    if at < 0:
                        return out
                    self._named = CallAssembler()
                    out += self._named.set_name(self._buf[:at].replace("[ARGS]", "").strip())
                    self._scanner, self._buf = ObjectScanner(), self._buf[at:]
                members, used = self._scanner.feed(self._buf)
                self._buf = self._buf[used:]
                for _, key, value in members:
                    out += self._named.add(key, value) if self._named else []
                if self._scanner.state != "done":
                    return out
                out += self._end_named_call(complete=True)
                self._mode = "start"
        return out

    def _end_array_call(self) -> list[ParseEvent]:
        assert self._call is not None
        events, self._call = self._call.close(), None
        self._num_calls += events is not None
        return events or []

    def _end_named_call(self, complete: bool) -> list[ParseEvent]:
        assert self._named is not None
        events, self._named, self._scanner = self._named.close(complete), None, None
        self._num_calls += events is not None
        return events or []

    def close(self, closed: bool) -> list[ParseEvent] | None:
        out: list[ParseEvent] = []
        if self._call is not None:
            out += self._end_array_call()
        if self._named is not None:
            out += self._end_named_call(complete=False)
        return out if self._num_calls else None


def mistral_parser() -> TaggedCallParser:
    """Calls run from [TOOL_CALLS] to the end of the reply (no closing marker: "\\x00" never comes)."""
    return TaggedCallParser(TOOL_CALLS, "\x00", MistralCallsBody)


class MistralFormat(ToolFormat):
    name = "mistral"
    markers = (TOOL_CALLS, "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
    tools_before_turns = True

    def tools_text(self, tools: list[dict[str, Any]]) -> str:
        entries = []
        for tool in tools:
            function = {k: v for k, v in tool["function"].items() if k != "return"}
            entries.append('{"type": "function", "function": ' + dumps(function) + "}")
        return "[AVAILABLE_TOOLS] [" + ", ".join(entries) + "][/AVAILABLE_TOOLS]"

    def system_text(self, system: str, tools_text: str) -> str:
        return tools_text + system if system else tools_text

    def call_text(self, call: CallItem) -> str:
        body = dumps({"name": call.name, "arguments": call.input})[:-1]
        return body + ', "id": "' + mistral_call_id(call.id) + '"}'

    def assistant_text(self, items: list[AssistantItem]) -> str:
        calls = [value for kind, value in items if kind == "call"]
        if not calls:
            return super().assistant_text(items)
        return TOOL_CALLS + " [" + ", ".join(self.call_text(call) for call in calls) + "]"

    def result_text(self, result: ResultItem) -> str:
        content = "Error: " + result.content if result.is_error else result.content
        call_id = mistral_call_id(result.tool_use_id)
        return '[TOOL_RESULTS] {"content": ' + content + ', "call_id": "' + call_id + '"}[/TOOL_RESULTS]'

    def result_turns(self, results: list[ResultItem]) -> list[tuple[TurnMarkers, str]] | None:
        return [(NO_MARKERS, "".join(self.result_text(result) for result in results))]

    def new_parser(self, tools: list[Any]) -> TaggedCallParser:
        return mistral_parser()
