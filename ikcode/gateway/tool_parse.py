"""Model text -> text pieces and tool calls, as the text streams in.

The model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (tool_format.py).
Text outside the tags passes through at once, except a tail that could be the start of an
opening tag. A call is emitted when its closing tag arrives (or at the end of the reply); JSON
that does not parse into a name and an object of arguments comes out as plain text, so a
confused model produces a readable answer, never a server error.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from ikcode.gateway.tool_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_ID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def new_tool_use_id() -> str:
    return "toolu_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class TextPiece:
    text: str


@dataclass
class ToolCall:
    id: str
    name: str
    input: dict[str, Any]


def parse_tool_call(raw: str) -> ToolCall | None:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_tool_use_id(), value["name"], arguments)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[TextPiece | ToolCall]:
        self._buf += text
        out: list[TextPiece | ToolCall] = []
        while True:
            if not self._in_call:
                at = self._buf.find(TOOL_CALL_OPEN)
                if at >= 0:
                    if at:
                        out.append(TextPiece(self._buf[:at]))
                    self._buf = self._buf[at + len(TOOL_CALL_OPEN) :]
                    self._in_call = True
                    continue
                keep = _partial_suffix(self._buf, TOOL_CALL_OPEN)
                ready = self._buf[: len(self._buf) - keep]
                if ready:
                    out.append(TextPiece(ready))
                self._buf = self._buf[len(self._buf) - keep :]
                return out
            at = self._buf.find(TOOL_CALL_CLOSE)
            if at < 0:
                return out
            raw, self._buf = self._buf[:at], self._buf[at + len(TOOL_CALL_CLOSE) :]
            self._in_call = False
            call = parse_tool_call(raw)
            out.append(call if call is not None else TextPiece(TOOL_CALL_OPEN + raw + TOOL_CALL_CLOSE))

    def finish(self) -> list[TextPiece | ToolCall]:
        """End of the reply: an unclosed call still counts if its JSON is complete."""
        buf, self._buf = self._buf, ""
        if not self._in_call:
            return [TextPiece(buf)] if buf else []
        self._in_call = False
        call = parse_tool_call(buf)
        return [call] if call is not None else [TextPiece(TOOL_CALL_OPEN + buf)]
