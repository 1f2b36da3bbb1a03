"""The deepseek_v3 tool-call parser on output the model may write but its template never shows."""

from __future__ import annotations

import json

from ikcode.gateway.tool_formats import FORMATS
from ikcode.gateway.tool_formats import deepseek_v3 as ds
from tests.tool_calls import collect

NEW_INPUT = {"path": "src/b.py", "limit": 5}


def test_deepseek_v3_call_with_its_object_on_the_name_line_is_parsed_at_every_split() -> None:
    """`function<sep>Read {...`: the model may open the arguments on the name's line instead of
    the next one. Every split parses to the same call and none raises (it raised ValueError)."""
    output = (
        f"{ds.CALLS_BEGIN}{ds.CALL_BEGIN}function{ds.SEP}Read {json.dumps(NEW_INPUT)}\n"
        f"{ds.CALL_END}{ds.CALLS_END}"
    )
    tools = [{"type": "function", "function": {"name": "Read", "description": "", "parameters": {}}}]
    for split in range(len(output) + 1):
        parser = FORMATS["deepseek_v3"]().new_parser(tools)
        events = parser.feed(output[:split]) + parser.feed(output[split:]) + parser.finish()
        _, calls = collect(events)
        assert [(c.name, c.input) for c in calls] == [("Read", NEW_INPUT)], split
