"""Shared fixtures and helpers of the gateway API tests (test_gateway_api, test_gateway_errors):
the tiny engine and tokenizer, a real uvicorn server on 127.0.0.1, the SDK client, error checks."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from ikcode.gateway import BackgroundServer, GatewaySettings, create_app
from tests.test_gateway_support import tiny_tokenizer
from tests.tiny_model import tiny_engine

TOKENS = {"alice": "tok-alice", "bob": "tok-bob"}
HELLO = [{"role": "user", "content": "hello there"}]
TOOL_CALL = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/repo/a.py"}}\n</tool_call>'
READ_TOOL = {"name": "Read", "description": "Read a file", "input_schema": {"type": "object"}}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def engine():
    engine = tiny_engine(kv_memory_bytes=4 * 1024 * 1024)  # 512 blocks: a 2048-token window
    engine.start()
    yield engine
    engine.shutdown(drain_timeout_s=1)


def settings(tmp_path, **overrides) -> GatewaySettings:
    values = dict(
        served_model="tiny",
        model_aliases=("claude-opus-4-8",),
        max_output_tokens=256,
        auth_tokens=dict(TOKENS),
        request_log_path=tmp_path / "requests.jsonl",
        ping_interval_s=0.1,
        default_temperature=0.0,
    )
    values.update(overrides)
    return GatewaySettings(**values)


@pytest.fixture(scope="module")
def server(engine, tokenizer, tmp_path_factory):
    app = create_app(engine, tokenizer, settings(tmp_path_factory.mktemp("gw")))
    srv = BackgroundServer(app).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=TOKENS["alice"], max_retries=0)


def serve(engine, tokenizer, tmp_path, **overrides) -> BackgroundServer:
    return BackgroundServer(create_app(engine, tokenizer, settings(tmp_path, **overrides))).start()


def assert_error(response: httpx.Response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == error_type
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body


def post(server, body, key: str | None = TOKENS["alice"], path: str = "/v1/messages", **kw) -> httpx.Response:
    headers = {"x-api-key": key} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30, **kw)


def assert_tool_result_reuses_the_reply(client, gateway, history, message, tool, tools) -> None:
    """The client sends a tool_use turn back with its result: the reply's generated token ids are
    reused (one reply-store hit), and the model answers with a tool call again."""
    hits = gateway.renderer.store.stats()["reply_hits"]
    follow_up = history + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "x = 1"}],
        },
    ]
    again = client.messages.create(model="tiny", max_tokens=200, messages=follow_up, tools=tools)
    assert gateway.renderer.store.stats()["reply_hits"] == hits + 1
    assert again.stop_reason == "tool_use"
