"""Hermes / Qwen2.5 / Qwen3: JSON calls in <tool_call></tool_call>, results in <tool_response>.

Markers as vLLM reads them (hermes_tool_parser.py:42-46 @836d1f3); tool list, call and result
text as Qwen3's chat template writes them (tests/data/chat_templates/qwen3.jinja).
"""

from __future__ import annotations

from typing import Any

from ikcode.gateway.tool_formats.base import CallItem, ParseEvent, ResultItem, ToolFormat, dumps
from ikcode.gateway.tool_formats.json_args import JsonCallParser
from ikcode.gateway.tool_formats.tagged import TaggedCallParser

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_HEADER = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class JsonCallBody:
    """The body of one tagged JSON call."""

    def __init__(self) -> None:
        self._parser = JsonCallParser()

    @property
    def in_string(self) -> bool:
        return self._parser.scanner.in_string

    @property
    def no_call(self) -> bool:
        """Its text began with something other than a JSON object: it can never be a call."""
        return self._parser.scanner.state == "failed" and not self._parser.call.started

    def feed(self, text: str) -> list[ParseEvent]:
        return self._parser.feed(text)[0]

    def close(self, closed: bool) -> list[ParseEvent] | None:
        return self._parser.close()


class HermesFormat(ToolFormat):
    name = "hermes"
    markers = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "<tool_response>", "</tool_response>")

    def tools_text(self, tools: list[dict[str, Any]]) -> str:
        return TOOLS_HEADER + "".join("\n" + dumps(tool) for tool in tools) + "\n" + TOOLS_FOOTER

    def call_text(self, call: CallItem) -> str:
        return f"{TOOL_CALL_OPEN}\n{dumps({'name': call.name, 'arguments': call.input})}\n{TOOL_CALL_CLOSE}"

    def result_text(self, result: ResultItem) -> str:
        content = "Error: " + result.content if result.is_error else result.content
        return f"<tool_response>\n{content}\n</tool_response>"

    def new_parser(self, tools: list[Any]) -> TaggedCallParser:
        return TaggedCallParser(TOOL_CALL_OPEN, TOOL_CALL_CLOSE, JsonCallBody)
