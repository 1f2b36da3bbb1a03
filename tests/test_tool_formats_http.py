"""Each tool format end to end: the real server on 127.0.0.1 and the official SDK, the engine's
tokens scripted to be the model's call in its family's syntax (`tool_format` set as a profile sets
it). The call comes back as a tool_use block whose input streamed in input_json_delta pieces, and
the client's follow-up with the result reuses the reply's generated ids."""

# ruff: noqa: F811 (the pytest fixtures imported from test_gateway_api_support are test arguments)
from __future__ import annotations

import anthropic
import pytest

from tests.test_gateway_api_support import (  # noqa: F401 (fixtures)
    TOKENS,
    assert_tool_result_reuses_the_reply,
    engine,
    serve,
    tokenizer,
)
from tests.test_gateway_support import ScriptedEngine, wait_idle

HELLO = [{"role": "user", "content": "Show me the first lines of a.py"}]
READ_TOOL = {
    "name": "Read",
    "description": "Read a file",
    "input_schema": {
        "type": "object",
        "properties": {"file_path": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["file_path"],
    },
}
EXPECTED = {"file_path": "/repo/a.py", "limit": 20}
CALLS = {
    "hermes": '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/repo/a.py", "limit": 20}}'
    "\n</tool_call>",
    "qwen3_coder": "<tool_call>\n<function=Read>\n<parameter=file_path>\n/repo/a.py\n</parameter>\n"
    "<parameter=limit>\n20\n</parameter>\n</function>\n</tool_call>",
    "llama3_json": '<|python_tag|>{"name": "Read", "parameters": {"file_path": "/repo/a.py", "limit": 20}}',
    "mistral": '[TOOL_CALLS] [{"name": "Read", "arguments": {"file_path": "/repo/a.py", "limit": 20}}]',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>Read\n```json\n"
    '{"file_path": "/repo/a.py", "limit": 20}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "harmony": "<|channel|>commentary to=functions.Read <|constrain|>json<|message|>"
    '{"file_path": "/repo/a.py", "limit": 20}',
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_call_streams_and_round_trips(name, engine, tokenizer, tmp_path):
    script = tokenizer.encode(CALLS[name]) + [tokenizer.token_to_id("<|im_end|>")]
    srv = serve(ScriptedEngine(engine, script), tokenizer, tmp_path, tool_format=name)
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key=TOKENS["alice"], max_retries=0)
        with client.messages.stream(
            model="tiny", max_tokens=200, messages=HELLO, tools=[READ_TOOL]
        ) as stream:
            events = list(stream)
            message = stream.get_final_message()
        assert message.stop_reason == "tool_use"
        assert [b.type for b in message.content] == ["tool_use"]
        tool = message.content[0]
        assert tool.name == "Read" and tool.input == EXPECTED
        deltas = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        assert len(deltas) >= 3  # one per argument, then the closing brace
        gw = srv.server.config.app.state.gateway
        assert gw.renderer.tool_format.name == name
        assert_tool_result_reuses_the_reply(client, gw, HELLO, message, tool, [READ_TOOL])
    finally:
        srv.stop()
    wait_idle(engine)
