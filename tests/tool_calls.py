"""Parser events -> text and calls, checking the event order a client relies on."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ikcode.gateway.tool_formats import TextPiece, ToolArgsDelta, ToolCallEnd, ToolCallStart


@dataclass
class Call:
    id: str
    name: str
    json: str = ""  # the concatenated ToolArgsDelta pieces
    input: dict[str, Any] = field(default_factory=dict)
    num_deltas: int = 0


def collect(events: list) -> tuple[str, list[Call]]:
    text, calls, open_call = "", [], None
    for event in events:
        if isinstance(event, TextPiece):
            assert open_call is None, "text inside a call"
            text += event.text
        elif isinstance(event, ToolCallStart):
            assert open_call is None
            open_call = Call(event.id, event.name)
        elif isinstance(event, ToolArgsDelta):
            assert open_call is not None
            open_call.json += event.partial_json
            open_call.num_deltas += 1
        elif isinstance(event, ToolCallEnd):
            assert open_call is not None
            open_call.input = event.input
            assert json.loads(open_call.json) == event.input, "pieces must add up to the input"
            assert open_call.json == json.dumps(event.input, ensure_ascii=False)
            calls.append(open_call)
            open_call = None
    assert open_call is None, "a call never ended"
    return text, calls
