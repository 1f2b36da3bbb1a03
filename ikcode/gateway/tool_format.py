"""The tool-calling format shown to the model (Hermes / Qwen2.5 style).

Tools are listed as JSON schemas inside <tools></tools> in the system turn; the model calls one
with <tool_call>{"name": ..., "arguments": {...}}</tool_call>; results come back inside
<tool_response></tool_response> in a user turn. Small open models were trained on this shape.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
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


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_section(tools: list[Any], tool_choice: Any | None) -> str:
    """The system-turn text describing the tools (empty when there is none to call)."""
    lines = []
    for tool in tools:
        if tool.input_schema is None:  # server tools (web search...) are not callable here
            continue
        function = {"name": tool.name, "description": tool.description or "", "parameters": tool.input_schema}
        lines.append(dumps({"type": "function", "function": function}))
    if not lines:
        return ""
    text = TOOLS_HEADER + "\n" + "\n".join(lines) + "\n" + TOOLS_FOOTER
    choice = getattr(tool_choice, "type", None)
    if choice == "any":
        text += "\n\nYou must call at least one function."
    elif choice == "tool" and tool_choice.name:
        text += f"\n\nYou must call the function {tool_choice.name}."
    elif choice == "none":
        text += "\n\nDo not call any function now; answer in text."
    return text


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"{TOOL_CALL_OPEN}\n{dumps({'name': name, 'arguments': arguments})}\n{TOOL_CALL_CLOSE}"


def tool_response_text(content: str, is_error: bool) -> str:
    if is_error:
        content = "Error: " + content
    return f"<tool_response>\n{content}\n</tool_response>"
