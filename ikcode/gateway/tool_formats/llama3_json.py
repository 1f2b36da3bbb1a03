"""Llama 3.x JSON calls: {"name": ..., "parameters": {...}}, optionally after <|python_tag|>.

Markers as vLLM reads them (llama_tool_parser.py @02de3de): a call is a reply that starts with
the tag (:49) or with "{" (:122-123), several calls separated by ";" (:82), the arguments under
"parameters" or "arguments" (:95-97; an object with neither raises there and the reply is
text, so here too: a reply that is a JSON object with a "name", a package.json, is no call without
the tag, and its events are held until an arguments member begins). Tool list, call and result
text as the Llama 3.1 JSON tool template writes them
(tests/data/chat_templates/llama3_1_json.jinja), with the tools in the system turn (the
template's `tools_in_user_message=false` layout): the first user message changes every
conversation, so tools there could not be shared by the prefix cache. With tools, the system
turn starts "Environment: ipython" as in the template (the role markers are probed without).
"""

from __future__ import annotations

import json
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
from ikcode.gateway.tool_formats.json_args import JsonCallParser
from ikcode.gateway.tool_formats.tagged import partial_suffix

PYTHON_TAG = "<|python_tag|>"
TOOLS_INTRO = (
    "You have access to the following functions. To call a function, please respond with JSON for a "
    'function call. Respond in the format {"name": function name, "parameters": dictionary of argument '
    "name and its value}. Do not use variables.\n\n"
)
IPYTHON = TurnMarkers("<|start_header_id|>ipython<|end_header_id|>\n\n", "<|eot_id|>")


class Llama3JsonParser:
    def __init__(self) -> None:
        self._buf = ""
        self._mode = "start"  # start -> calls | text
        self._call: JsonCallParser | None = None
        self._raw = ""
        self._tagged = False  # after <|python_tag|>: a call whatever its members
        self._held: list[ParseEvent] = []  # an untagged call's events until its arguments begin

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        out: list[ParseEvent] = []
        while self._buf:
            if self._mode == "text":
                out.append(TextPiece(self._buf))
                self._buf = ""
            elif self._mode == "start":
                stripped = self._buf.lstrip()
                if not stripped or (partial_suffix(stripped, PYTHON_TAG) == len(stripped)):
                    return out  # only whitespace or the start of the tag so far
                if stripped.startswith(PYTHON_TAG):
                    self._buf, self._mode, self._tagged = stripped[len(PYTHON_TAG) :], "calls", True
                elif stripped.startswith("{"):
                    self._buf, self._mode = stripped, "calls"
                else:
                    self._mode = "text"
            elif self._call is None:  # between calls: ";" and whitespace, then "{" or plain text
                stripped = self._buf.lstrip().lstrip(";").lstrip()
                if not stripped:
                    self._buf = ""
                    return out
                if not stripped.startswith("{"):
                    self._buf, self._mode = stripped, "text"
                    continue
                self._buf, self._call, self._raw = stripped, JsonCallParser(), ""
            else:
                events, used = self._call.feed(self._buf)
                self._raw += self._buf[:used]
                self._buf = self._buf[used:]
                if self._tagged or self._call.has_arguments:
                    out += self._held + events
                    self._held = []
                else:
                    self._held += events
                if not self._call.done:
                    return out
                out += self._close()
        return out

    def _close(self) -> list[ParseEvent]:
        assert self._call is not None
        call, self._call, held = self._call, None, self._held
        self._held = []
        if not (self._tagged or call.has_arguments):  # a JSON object, not a call: its text
            self._mode = "text"
            return [TextPiece(self._raw)]
        events = call.close()
        return held + events if events is not None else [TextPiece(self._raw)]

    def finish(self) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        if self._call is not None:
            out += self._close()
        if self._buf.strip() and self._mode != "calls":
            out.append(TextPiece(self._buf))
        self._buf = ""
        return out


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def tools_text(self, tools: list[dict[str, Any]]) -> str:
        return TOOLS_INTRO + "".join(
            json.dumps(tool, ensure_ascii=False, indent=4) + "\n\n" for tool in tools
        )

    def system_prefix(self, prefix: str) -> str:
        # The template's system turn starts "Environment: ipython" when there are tools.
        header = "<|start_header_id|>system<|end_header_id|>\n\n"
        return prefix.replace(header, header + "Environment: ipython\n", 1)

    def system_text(self, system: str, tools_text: str) -> str:
        return tools_text + system  # the template: the tools, then the system message

    def call_text(self, call: CallItem) -> str:
        return '{"name": "' + call.name + '", "parameters": ' + dumps(call.input) + "}"

    def assistant_text(self, items: list[AssistantItem]) -> str:
        calls = [value for kind, value in items if kind == "call"]
        if not calls:
            return super().assistant_text(items)
        # The template writes only the call; several (which it refuses) as the parser reads them.
        return "; ".join(self.call_text(call) for call in calls)

    def result_text(self, result: ResultItem) -> str:
        content = "Error: " + result.content if result.is_error else result.content
        return dumps({"output": content})

    def result_turns(self, results: list[ResultItem]) -> list[tuple[TurnMarkers, str]] | None:
        return [(IPYTHON, self.result_text(result)) for result in results]

    def new_parser(self, tools: list[Any]) -> Llama3JsonParser:
        return Llama3JsonParser()
