"""Qwen3-Coder: XML calls, <tool_call><function=NAME><parameter=KEY>value</parameter></function>.

Markers as vLLM reads them (qwen3coder_tool_parser.py:37-42 @0054011; a parameter ends at
</parameter>, the next <parameter= or </function>, :56-58); tool list, call and result text as
the Qwen3-Coder chat template writes them (tests/data/chat_templates/qwen3_coder.jinja). Parameter
values are raw text, typed by the tool's JSON schema as vLLM's parser does (_convert_param_value,
:124 on): strings stay text, numbers and booleans are converted (nan and inf stay text: JSON has
no such number), objects and arrays parsed (with json_repair when sloppy), any other type (a
union, "any") taken as a Python literal when it is one and kept as text otherwise, and "null" is
None. Each <function=...> of a <tool_call> is a call of its own, as vLLM finds them all.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from ikcode.gateway.tool_formats.base import (
    AssistantItem,
    CallItem,
    ParseEvent,
    ResultItem,
    ToolFormat,
    dumps,
)
from ikcode.gateway.tool_formats.json_args import CallAssembler, loads_lenient
from ikcode.gateway.tool_formats.tagged import TaggedCallParser

TOOLS_INTRO = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_OUTRO = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:"
    "\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1"
    "\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter"
    "\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:"
    "\n- Function calls MUST follow the specified format: an inner <function=...></function> block "
    "must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified"
    "\n- You may provide optional reasoning for your function call in natural language BEFORE the "
    "function call, but NOT after\n- If there is no function call available, answer the question like "
    "normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>"
)
_FUNCTION = re.compile(r"<function=([^>\n]*)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>")
_PARAMETER_END = re.compile(r"</parameter>|<parameter=|</function>")
_LONGEST_END = len("</parameter>")  # an end marker may begin this many characters back, less one
# What the template writes after a parameter's </parameter>: the next parameter or the call's end.
_AFTER_PARAMETER = ("<parameter=", "</function>", "</tool_call>")


_MAX_GAP = 64  # whitespace between a </parameter> and what follows it, at most
_NOT_SPACE = re.compile(r"\S")


def _closes_value(buf: str, after: int, final: bool) -> bool | None:
    """Whether the </parameter> ending at `after` ends the value: only if the next parameter or
    the call's end follows it (a file that mentions </parameter> is a value that holds it). None:
    not known until more text arrives. Looks at most _MAX_GAP characters ahead: each delta asks
    again, and a long run of whitespace rescanned each time made a value quadratic."""
    follows = _NOT_SPACE.search(buf, after, after + _MAX_GAP + 1)
    if follows is None:
        if len(buf) - after > _MAX_GAP:
            return False  # that much whitespace is the value's own
        return True if final else None
    rest = buf[follows.start() : follows.start() + len("</tool_call>")]
    if rest.startswith(_AFTER_PARAMETER):
        return True
    if any(marker.startswith(rest) for marker in _AFTER_PARAMETER):
        return True if final else None
    return False


def _as_text(value: Any) -> str:
    """A value as the template writes it: objects and arrays as JSON, the rest as Jinja's |string."""
    return dumps(value) if isinstance(value, dict | list) else str(value)


_TAG_NAMES = ("tool_call", "tool_response")


def _extra_keys(fields: Any, handled: tuple[str, ...]) -> str:
    if not isinstance(fields, dict):
        return ""
    # A key spelling a tag (`tool_call`, or anything with < or >) is left out: written as
    # <key>, a tool definition's schema would make the format's own control tokens.
    return "".join(
        f"\n<{key}>{_as_text(value)}</{key}>"
        for key, value in fields.items()
        if key not in handled and key not in _TAG_NAMES and not set(str(key)) & {"<", ">"}
    )


def convert_value(raw: str, schema: Any) -> Any:
    """A parameter's text as the type its schema declares (vLLM's _convert_param_value rules,
    except that a string parameter keeps the text "null": vLLM reads it as null first, and an
    Edit whose new_string is "null" then failed the tool's validation)."""
    kind = str(schema.get("type", "string")).strip().lower() if isinstance(schema, dict) else "string"
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return raw
    if raw.lower() == "null":
        return None
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(raw)
        except ValueError:
            return raw
    if kind.startswith(("num", "float")):
        try:
            number = float(raw)
        except ValueError:
            return raw
        if number != number or number in (float("inf"), float("-inf")):
            return raw  # vLLM: int(nan/inf) raises, the text stays
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return raw.lower() == "true"
    if raw.lstrip()[:1] in ("{", "["):
        value = loads_lenient(raw)
        return raw if value is None or value == "" else value
    try:
        return ast.literal_eval(raw)  # as vLLM; anything else stays text
    except Exception:
        return raw


class XmlCallBody:
    def __init__(self, schemas: dict[str, dict[str, Any]]):
        self.schemas = schemas
        self.call = CallAssembler()
        self._buf = ""
        self._properties: dict[str, Any] = {}
        self._closed_calls = 0
        # A parameter whose value has begun and not ended: where in _buf its value starts, and
        # from where to look for its end again (what was searched holds no end marker). Without
        # them each delta scanned the whole value again: a 100 KB Write fed a few characters at
        # a time took seconds of the event loop.
        self._open: int | None = None
        self._scan_from = 0
        self._maybe_closed = False  # the open value's last </parameter> may be its end

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        events: list[ParseEvent] = []
        while True:
            if self.call.name is None:
                match = _FUNCTION.search(self._buf)
                if match is None:
                    return events
                name = match.group(1).strip()
                self._properties = self.schemas.get(name, {})
                self._buf = self._buf[match.end() :]
                events += self.call.set_name(name)
            events += self._parameters(final=False)
            if self._open is not None:  # inside a value: no </function> anywhere after it
                return events
            end = self._buf.find("</function>")
            if end < 0 or _FUNCTION.search(self._buf, end) is None:
                return events  # this function may still go on; only a next <function= ends it here
            # vLLM reads every <function=...></function> in a <tool_call> as its own call
            self._buf = self._buf[end + len("</function>") :]
            events += self.call.close(complete=True) or []
            self._closed_calls += 1
            self.call = CallAssembler()

    @property
    def in_string(self) -> bool:
        """Inside a parameter's value (opened, not ended): a </tool_call> here is the value's
        text (a Write of code about tool calls), not the end of the call. The template closes
        every parameter before the call ends."""
        return self.call.name is not None and self._open is not None and not self._maybe_closed

    def _parameters(self, final: bool) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        while True:
            start = _PARAMETER.search(self._buf)
            if start is None or self._buf.find("</function>", 0, start.start()) >= 0:
                self._open, self._maybe_closed = None, False
                return events  # none left in this function
            end = _PARAMETER_END.search(self._buf, max(start.end(), self._scan_from))
            closes = None if end is None else True
            while end is not None and end.group() == "</parameter>":
                closes = _closes_value(self._buf, end.end(), final)
                if closes is not False:
                    break
                end = _PARAMETER_END.search(self._buf, end.end())  # the value's own text
            if (end is None or closes is None) and not final:
                self._open, self._maybe_closed = start.end(), end is not None
                self._scan_from = (
                    end.start() if end is not None else max(start.end(), len(self._buf) - _LONGEST_END + 1)
                )
                return events
            self._open, self._scan_from, self._maybe_closed = None, 0, False
            stop = end.start() if end is not None else len(self._buf)
            value = self._buf[start.end() : stop]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            key = start.group(1).strip()
            events += self.call.add(key, convert_value(value, self._properties.get(key)))
            self._buf = self._buf[end.end() if end is not None and end.group() == "</parameter>" else stop :]

    def close(self, closed: bool) -> list[ParseEvent] | None:
        events = self._parameters(final=True) if closed else []
        tail = self.call.close(complete=closed)
        if tail is None:
            return events if self._closed_calls else None
        return events + tail


class Qwen3CoderFormat(ToolFormat):
    name = "qwen3_coder"
    markers = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
    text_joiner = ""

    def tools_text(self, tools: list[dict[str, Any]]) -> str:
        text = TOOLS_INTRO
        for tool in tools:
            function = tool["function"]
            text += f"\n<function>\n<name>{function['name']}</name>"
            if function.get("description") is not None:
                text += f"\n<description>{function['description'].strip()}</description>"
            text += "\n<parameters>"
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            for name, fields in (properties or {}).items() if isinstance(properties, dict) else ():
                text += f"\n<parameter>\n<name>{name}</name>"
                if isinstance(fields, dict) and "type" in fields:
                    text += f"\n<type>{fields['type']}</type>"
                if isinstance(fields, dict) and "description" in fields:
                    text += f"\n<description>{str(fields['description']).strip()}</description>"
                text += _extra_keys(fields, ("name", "type", "description")) + "\n</parameter>"
            text += _extra_keys(parameters, ("type", "properties")) + "\n</parameters>"
            text += _extra_keys(function, ("type", "name", "description", "parameters")) + "\n</function>"
        return text + TOOLS_OUTRO

    def call_text(self, call: CallItem) -> str:
        parameters = "".join(f"<parameter={k}>\n{_as_text(v)}\n</parameter>\n" for k, v in call.input.items())
        return f"<tool_call>\n<function={call.name}>\n{parameters}</function>\n</tool_call>"

    def assistant_text(self, items: list[AssistantItem]) -> str:
        calls = [value for kind, value in items if kind == "call"]
        if not calls:
            return super().assistant_text(items)
        # The template: "\n" + trimmed content + "\n", then "\n" + each call; the turn's opening
        # (the generation prompt) already ends in that first "\n".
        content = "\n".join(value for kind, value in items if kind == "text").strip()
        text = (f"\n{content}\n" if content else "") + "".join("\n" + self.call_text(call) for call in calls)
        return text[1:]

    def result_text(self, result: ResultItem) -> str:
        content = "Error: " + result.content if result.is_error else result.content
        return f"<tool_response>\n{content}\n</tool_response>\n"

    def user_text(self, items: list[Any]) -> str:
        return "".join(value if kind == "text" else self.result_text(value) for kind, value in items)

    def new_parser(self, tools: list[Any]) -> TaggedCallParser:
        schemas = {}
        for tool in tools:
            function = tool.get("function", {}) if isinstance(tool, dict) else {}
            properties = (function.get("parameters") or {}).get("properties")
            schemas[function.get("name")] = properties if isinstance(properties, dict) else {}
        return TaggedCallParser("<tool_call>", "</tool_call>", lambda: XmlCallBody(schemas))
