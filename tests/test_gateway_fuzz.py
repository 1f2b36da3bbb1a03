"""Fuzz: thousands of malformed or random requests, zero 5xx, every error in Anthropic's shape."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from ikcode.gateway import GatewaySettings, create_app
from tests.test_gateway_support import tiny_tokenizer, wait_idle
from tests.tiny_model import tiny_engine

ERROR_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
               "request_too_large", "rate_limit_error", "api_error", "overloaded_error"}  # fmt: skip
EXAMPLES = 2100

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=10**20, max_value=10**40)
    | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)  # fmt: skip
roles = st.sampled_from(["user", "assistant", "system", "tool", "", "USER", 3])
block_types = st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking",
                               "document", "server_tool_use", "video", ""])  # fmt: skip


@st.composite
def blocks(draw):
    block = {"type": draw(block_types)}
    for key in draw(st.lists(st.sampled_from(["text", "id", "name", "input", "tool_use_id", "content",
                                              "is_error", "thinking", "signature", "data", "source",
                                              "cache_control", "title"]), max_size=5)):  # fmt: skip
        block[key] = draw(json_values | st.text(max_size=30))
    return block


messages = st.lists(
    st.fixed_dictionaries({"role": roles, "content": st.text(max_size=30) | st.lists(blocks(), max_size=3)}),
    max_size=4,
)
FIELDS = {
    "model": st.sampled_from(["tiny", "claude-opus-4-8", "nope", ""]) | json_values,
    "max_tokens": st.integers(min_value=-5, max_value=12) | st.integers() | json_values,
    "messages": messages | json_values,
    "system": st.text(max_size=30) | st.lists(blocks(), max_size=2) | json_values,
    "tools": st.lists(
        st.fixed_dictionaries({"name": st.text(max_size=8), "input_schema": json_values}), max_size=2
    )
    | json_values,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])})
    | json_values,
    "stop_sequences": st.lists(st.text(max_size=4), max_size=3) | json_values,
    "temperature": st.floats(allow_nan=False) | json_values,
    "top_p": st.floats(allow_nan=False) | json_values,
    "top_k": st.integers() | json_values,
    "stream": st.booleans() | json_values,
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["adaptive", "enabled", "disabled"])})
    | json_values,
    "output_config": st.sampled_from([{"effort": "high"}, {"format": {"type": "json_schema", "schema": {}}}])
    | json_values,
    "metadata": json_values,
}


@st.composite
def message_bodies(draw):
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=5, unique=True)):
        if draw(st.booleans()) and key in body:
            del body[key]
        else:
            body[key] = draw(FIELDS[key])
    return json.dumps(body).encode()


requests = st.tuples(
    st.sampled_from(
        [
            "POST /v1/messages",
            "POST /v1/messages/count_tokens",
            "POST /v1/messages?beta=true",
            "POST /pre/fix/v1/messages",
            "GET /v1/models",
            "GET /v1/models/x",
            "PUT /v1/messages",
            "GET /v1/nothing",
            "DELETE /health",
        ]
    ),  # fmt: skip
    message_bodies() | json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64),
)


@pytest.fixture(scope="module")
def fuzz_client():
    engine = tiny_engine(kv_memory_bytes=2 * 1024 * 1024)
    engine.start()
    gateway_settings = GatewaySettings(
        served_model="tiny", model_aliases=("claude-opus-4-8",), max_output_tokens=8, default_temperature=0.0
    )
    with TestClient(
        create_app(engine, tiny_tokenizer(), gateway_settings), raise_server_exceptions=False
    ) as client:
        yield client, engine
    engine.shutdown(drain_timeout_s=1)


@pytest.mark.slow
def test_fuzzed_requests_never_5xx(fuzz_client):
    client, engine = fuzz_client
    seen = {"count": 0, "ok": 0}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(requests)
    def one(request):
        route, body = request
        method, path = route.split(" ")
        response = client.request(method, path, content=body, headers={"content-type": "application/json"})
        seen["count"] += 1
        assert response.status_code < 500, (route, body[:300], response.text[:300])
        if response.status_code >= 400:
            error = response.json()
            assert error["type"] == "error" and error["error"]["type"] in ERROR_TYPES
            assert isinstance(error["error"]["message"], str)
        else:
            seen["ok"] += 1

    one()
    assert seen["count"] >= 2000
    assert seen["ok"] > 50  # the generator also reaches the happy path
    reply = client.post(
        "/v1/messages",
        json={"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert reply.status_code == 200 and reply.json()["type"] == "message"
    wait_idle(engine)
