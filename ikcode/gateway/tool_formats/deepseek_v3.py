"""DeepSeek V3: calls between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, each
<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>.

Markers as vLLM reads them (deepseekv3_tool_parser.py:53-61 @061b11d); V3.1's
`NAME<｜tool▁sep｜>{...}` is read too. Calls and results as DeepSeek V3's own chat template
writes them (tests/data/chat_templates/deepseek_v3.jinja). That template has no tool list; the
list is vLLM's DeepSeek V3 tool template's (a Hermes-style list and the call syntax).
"""

from __future__ import annotations

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
from ikcode.gateway.tool_formats.json_args import CallAssembler, ObjectScanner
from ikcode.gateway.tool_formats.tagged import TaggedCallParser

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor function call returns, you should first print <｜tool▁calls▁begin｜>"
    "For each function call, you should return object like:\n"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜><function_name>\n```json\n<function_arguments_in_json_format>"
    "\n```<｜tool▁call▁end｜>At the end of function call returns, you should print "
    "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
)


class DeepSeekCallBody:
    """One call: `function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```` (or V3.1: `NAME<｜tool▁sep｜>{...}`)."""

    def __init__(self) -> None:
        self.call = CallAssembler()
        self._buf = ""
        self._scanner: ObjectScanner | None = None

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        events: list[ParseEvent] = []
        if self._scanner is None:
            if SEP not in self._buf:
                return []
            kind, rest = self._buf.split(SEP, 1)
            if kind.strip() == "function":  # V3: the name is the rest of the line, then ```json
                if "{" not in rest:
                    return []
                # The name ends at the line's end, or at the object when the model starts it on
                # the same line (`Read {...`).
                newline = rest.find("\n")
                end = rest.index("{") if newline < 0 else min(newline, rest.index("{"))
                name, rest = rest[:end], rest[end:]
            else:
                if "{" not in rest:
                    return []
                name = kind
            events += self.call.set_name(name.strip())
            self._scanner, self._buf = ObjectScanner(), rest[rest.index("{") :]
        members, used = self._scanner.feed(self._buf)
        self._buf = self._buf[used:]
        for _, key, value in members:
            events += self.call.add(key, value)
        return events

    def close(self, closed: bool) -> list[ParseEvent] | None:
        complete = self._scanner is not None and self._scanner.state == "done"
        return self.call.close(complete)


class DeepSeekCallsBody:
    """Everything between the calls markers: the calls, and the newlines between them."""

    def __init__(self) -> None:
        self._calls = TaggedCallParser(CALL_BEGIN, CALL_END, DeepSeekCallBody)
        self._num_events = 0

    def feed(self, text: str) -> list[ParseEvent]:
        return self._keep_calls(self._calls.feed(text))

    def close(self, closed: bool) -> list[ParseEvent] | None:
        events = self._keep_calls(self._calls.finish())
        return events if self._num_events else None

    def _keep_calls(self, events: list[ParseEvent]) -> list[ParseEvent]:
        kept = [event for event in events if not isinstance(event, TextPiece)]
        self._num_events += len(kept)
        return kept


class DeepSeekV3Format(ToolFormat):
    name = "deepseek_v3"
    markers = (
        CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP,
        OUTPUTS_BEGIN, OUTPUTS_END, OUTPUT_BEGIN, OUTPUT_END,
    )  # fmt: skip

    def tools_text(self, tools: list[dict[str, Any]]) -> str:
        return TOOLS_HEADER + "".join("\n" + dumps(tool) for tool in tools) + TOOLS_FOOTER

    def system_text(self, system: str, tools_text: str) -> str:
        return system + tools_text  # the list opens with its own blank line

    def call_text(self, call: CallItem) -> str:
        return f"{CALL_BEGIN}function{SEP}{call.name}\n```json\n{dumps(call.input)}\n```{CALL_END}"

    def assistant_text(self, items: list[AssistantItem]) -> str:
        calls = [value for kind, value in items if kind == "call"]
        if not calls:
            return super().assistant_text(items)
        content = "\n".join(value for kind, value in items if kind == "text")
        # DeepSeek's template closes the calls (<｜tool▁calls▁end｜>) only after a second call;
        # one call is left open, and rendered so here to keep the model's own prompt.
        closing = CALLS_END if len(calls) > 1 else ""
        return content + CALLS_BEGIN + "\n".join(self.call_text(call) for call in calls) + closing

    def result_text(self, result: ResultItem) -> str:
        content = "Error: " + result.content if result.is_error else result.content
        return OUTPUT_BEGIN + content + OUTPUT_END

    def result_turns(self, results: list[ResultItem]) -> list[tuple[TurnMarkers, str]] | None:
        body = "\n".join(self.result_text(result) for result in results)
        return [(TurnMarkers(OUTPUTS_BEGIN, OUTPUTS_END), body)]

    def new_parser(self, tools: list[Any]) -> TaggedCallParser:
        return TaggedCallParser(CALLS_BEGIN, CALLS_END, DeepSeekCallsBody)
