"""A Claude Code shaped conversation, twice: the second turn must find the first one cached.

Shape from the observed facts (ikcode/gateway/claude_code_shape.py): 24 tools, a billing line in
system[0], ~18K tokens of system + tools, an earlier tool_use/tool_result round trip, a
mid-conversation system message, cache_control markers that move. The engine is the real
embedded engine over a tiny random model with a 32K window.
"""

from __future__ import annotations

import copy

import anthropic
import pytest

from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from ikcode.gateway import BackgroundServer, GatewaySettings, create_app
from ikcode.gateway.claude_code_shape import claude_code_request, with_turn
from tests.test_gateway_support import tiny_tokenizer, wait_idle
from tests.tiny_model import tiny_config, tiny_state_dict

SCALE = 0.2  # ~18K tokens of system + tools with the byte-level test vocabulary


@pytest.fixture(scope="module")
def engine():
    cfg = tiny_config(max_position_embeddings=32768)
    engine = EmbeddedEngine(
        cfg,
        tiny_state_dict(cfg),
        EmbeddedEngineConfig(kv_memory_bytes=24 * 1024 * 1024, num_threads=1, device="cpu",
                             max_prefill_tokens_per_step=2048),
    )  # fmt: skip
    engine.start()
    yield engine
    engine.shutdown(drain_timeout_s=1)


def first_request() -> dict:
    """The first request, after one tool round trip and a mid-conversation system message."""
    request = claude_code_request(scale=SCALE, billing_hex="3f9")
    tool_use = {"type": "tool_use", "id": "toolu_01ABC", "name": "Glob", "input": {"pattern": "**/*.py"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_01ABC", "content": "src/main.py\nsrc/util.py"}
    request = with_turn(request, [{"type": "text", "text": "Looking for files."}, tool_use], [result])
    request["messages"].append({"role": "system", "content": "The user switched to plan mode."})
    request["messages"].append({"role": "user", "content": [{"type": "text", "text": "Now read main.py."}]})
    return request


def stream_call(client: anthropic.Anthropic, request: dict, session: str):
    body = copy.deepcopy(request)
    body.pop("stream")
    body["max_tokens"] = 24  # a random model rarely stops on its own
    extra = {"context_management": body.pop("context_management")}
    with client.messages.stream(
        **body, extra_body=extra, extra_headers={"X-Claude-Code-Session-Id": session}
    ) as stream:
        return stream.get_final_message()


@pytest.mark.slow
def test_second_turn_hits_first_turn_and_reply(engine, tmp_path):
    tokenizer = tiny_tokenizer()
    settings = GatewaySettings(
        served_model="tiny", model_aliases=("claude-opus-4-8",), default_temperature=0.0,
        request_log_path=tmp_path / "requests.jsonl",
    )  # fmt: skip
    srv = BackgroundServer(create_app(engine, tokenizer, settings)).start()
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
        request = first_request()
        first = stream_call(client, request, "sess-1")
        first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
        system_and_tools = client.messages.count_tokens(
            model="claude-opus-4-8", system=request["system"], tools=request["tools"],
            messages=[{"role": "user", "content": "x"}],
        ).input_tokens  # fmt: skip
        assert 15_000 <= system_and_tools <= 21_000
        wait_idle(engine)  # the first turn's blocks are committed at release

        echoed = [block.model_dump(exclude_none=True) for block in first.content]
        for block in echoed:
            block.pop("citations", None)
        second_request = with_turn(request, echoed, [{"type": "text", "text": "Thanks, go on."}])
        second = stream_call(client, second_request, "sess-1")
        reused = first_prompt + first.usage.output_tokens
        print(f"first prompt {first_prompt} + reply {first.usage.output_tokens}; second: {second.usage}")
        assert second.usage.cache_read_input_tokens >= 0.95 * reused, (second.usage, reused)
        assert second.usage.input_tokens + second.usage.cache_read_input_tokens > reused
    finally:
        srv.stop()
    wait_idle(engine)
