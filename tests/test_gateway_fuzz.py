"""Fuzz: thousands of malformed, huge, deeply nested, badly encoded or random requests, streamed
or not, against the real server over HTTP: zero 5xx, every error in Anthropic's shape, every
stream well-formed to its end, and afterwards a healthy server with every KV block back."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ikcode.gateway import GatewaySettings, create_app
from ikcode.gateway.server import BackgroundServer
from tests.test_gateway_support import tiny_tokenizer, wait_idle
from tests.tiny_model import assert_pool_clean, tiny_engine

ERROR_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
               "request_too_large", "rate_limit_error", "api_error", "overloaded_error"}  # fmt: skip
EXAMPLES = 2100

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=10**20, max_value=10**40)
    | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)  # fmt: skip
# Sampling values at the edges of what a float sampler survives (the smallest ones gave NaN).
tiny_or_odd_numbers = st.sampled_from(
    [0.0, -0.0, 1e-45, 1e-39, 1e-300, 5e-324, 1e-6, 1e-5, 0.5, 1.0, 1.0000001, 2.0, 1e308, -1e-300]
)
roles = st.sampled_from(["user", "assistant", "system", "tool", "", "USER", 3])
block_types = st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking",
                               "document", "server_tool_use", "video", "", "search_result",
                               "web_search_tool_result", "container_upload", "TEXT"])  # fmt: skip


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
    "temperature": st.floats(allow_nan=False) | tiny_or_odd_numbers | json_values,
    "top_p": st.floats(allow_nan=False) | tiny_or_odd_numbers | json_values,
    "top_k": st.integers() | st.sampled_from([0, 1, 299, 300, 10**9, -1]) | json_values,
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
    body["stream"] = draw(st.booleans())
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=5, unique=True)):
        if draw(st.booleans()) and key in body:
            del body[key]
        else:
            body[key] = draw(FIELDS[key])
    return json.dumps(body).encode()


@st.composite
def sampling_bodies(draw):
    """An otherwise valid request with sampling values at the edges (these reach the sampler)."""
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for key in draw(st.lists(st.sampled_from(["temperature", "top_p", "top_k"]), min_size=1, unique=True)):
        body[key] = draw(FIELDS[key] if key == "top_k" else tiny_or_odd_numbers)
    body["stream"] = draw(st.booleans())
    return json.dumps(body).encode()


@st.composite
def deep_bodies(draw):
    """Nesting far past any parser's comfort, in the body or inside a field."""
    depth = draw(st.sampled_from([64, 1000, 5000, 100_000]))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    nested = opener * depth + "1" + closer * depth
    where = draw(st.sampled_from(["body", "content", "input", "metadata"]))
    if where == "body":
        return nested.encode()
    if where == "content":
        return f'{{"model":"tiny","max_tokens":4,"messages":[{{"role":"user","content":{nested}}}]}}'.encode()
    if where == "input":
        block = f'{{"type":"tool_use","id":"t","name":"x","input":{{"v":{nested}}}}}'
        messages = f'[{{"role":"assistant","content":[{block}]}}]'
        return f'{{"model":"tiny","max_tokens":4,"messages":{messages}}}'.encode()
    return f'{{"model":"tiny","max_tokens":4,"metadata":{{"v":{nested}}},"messages":[]}}'.encode()


@st.composite
def badly_encoded_bodies(draw):
    """Valid JSON around bytes that are not UTF-8 (or lone surrogates written as escapes)."""
    bad = draw(
        st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x00", b"\\ud800"])
    )
    stream = draw(st.sampled_from([b"true", b"false"]))
    return (
        b'{"model":"tiny","max_tokens":4,"stream":' + stream
        + b',"messages":[{"role":"user","content":"a' + bad + b'b"}]}'
    )  # fmt: skip


@st.composite
def huge_bodies(draw):
    """Over the body limit, or under it with more text than the window holds."""
    size = draw(st.sampled_from([200_000, 600_000, 3 * 1024 * 1024]))
    text = draw(st.sampled_from(["x", "hello ", "\u00e9", "\ud83d\ude00"])) * (size // 6)
    return json.dumps(
        {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    ).encode()


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
    st.one_of(
        message_bodies(),
        sampling_bodies(),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        deep_bodies(),
        badly_encoded_bodies(),
        huge_bodies(),
    ),
)


@pytest.fixture(scope="module")
def fuzz_server():
    engine = tiny_engine(kv_memory_bytes=2 * 1024 * 1024)
    engine.start()
    gateway_settings = GatewaySettings(
        served_model="tiny", model_aliases=("claude-opus-4-8",), max_output_tokens=8, default_temperature=0.0
    )
    app = create_app(engine, tiny_tokenizer(), gateway_settings)
    server = BackgroundServer(app).start()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client, engine, app.state.gateway
    server.stop()
    engine.shutdown(drain_timeout_s=1)


def check_error(response: httpx.Response) -> None:
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] in ERROR_TYPES
    assert isinstance(error["error"]["message"], str)


def check_stream(text: str) -> None:
    """Every event a well-formed SSE frame with JSON data; the stream ends in message_stop or an
    error event."""
    frames = [f for f in text.split("\n\n") if f.strip()]
    assert frames, "an empty event stream"
    kinds = []
    for frame in frames:
        event, data = frame.split("\n", 1)
        assert event.startswith("event: ") and data.startswith("data: "), frame[:200]
        payload = json.loads(data[len("data: ") :])
        assert payload["type"] == event[len("event: ") :]
        kinds.append(payload["type"])
        if payload["type"] == "error":
            assert payload["error"]["type"] in ERROR_TYPES
    assert kinds[0] == "message_start" and kinds[-1] in ("message_stop", "error"), kinds


@pytest.mark.slow
def test_fuzzed_requests_never_5xx(fuzz_server):
    client, engine, gw = fuzz_server
    seen = {"count": 0, "ok": 0, "streams": 0}

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
            check_error(response)
            return
        seen["ok"] += 1
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            seen["streams"] += 1
            check_stream(response.text)

    one()
    assert seen["count"] >= 2000
    assert seen["ok"] > 50 and seen["streams"] > 20  # the generator also reaches the happy path
    reply = client.post(
        "/v1/messages",
        json={"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert reply.status_code == 200 and reply.json()["type"] == "message"
    assert client.get("/health").json()["status"] == "ok"
    wait_idle(engine)
    assert gw.in_flight == 0 and not gw.generations
    assert_pool_clean(engine)  # 0 leaked blocks: every block free or evictable, books agree
