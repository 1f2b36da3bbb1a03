"""The gateway over the real embedded engine (tiny random model), through the official SDK, on a
real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import json
import re
import time

import anthropic
import httpx
import pytest

from ikcode.engines.base import EngineOverloaded, FinishReason, RequestStream, TokenEvent
from ikcode.gateway import BackgroundServer, GatewaySettings, create_app
from tests.test_gateway_support import (
    ScriptedEngine,
    hang_up_before_the_first_chunk,
    tiny_tokenizer,
    wait_idle,
)
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


# ---- happy paths -------------------------------------------------------------------------------
def test_create_and_repeat_hits_the_cache(client, engine):
    first = client.messages.create(model="tiny", max_tokens=8, messages=HELLO)
    assert first.type == "message" and first.role == "assistant" and first.model == "tiny"
    assert first.stop_reason in ("end_turn", "max_tokens") and first.usage.output_tokens >= 1
    assert first.id.startswith("msg_")
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    wait_idle(engine)
    second = client.messages.create(model="tiny", max_tokens=8, messages=HELLO)
    assert second.content == first.content  # temperature 0 (the server default here)
    block = engine.info.block_size
    assert second.usage.cache_read_input_tokens == prompt // block * block
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == prompt


def test_stream_text(client, engine):
    with client.messages.stream(model="claude-opus-4-8", max_tokens=12, messages=HELLO) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds
    assert message.usage.output_tokens >= 1
    assert message.stop_reason in ("end_turn", "max_tokens")
    wait_idle(engine)


def test_sampling_parameters_accepted(client):
    reply = client.messages.create(
        model="tiny", max_tokens=4, messages=HELLO, stop_sequences=["zzzz"], metadata={"user_id": "u"},
        thinking={"type": "adaptive"}, output_config={"effort": "high"},
        # This SDK version has no temperature/top_p/top_k arguments; the API still takes them.
        extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20, "context_management": {"edits": []},
                    "brand_new": 1},
    )  # fmt: skip
    assert reply.usage.output_tokens <= 4


def test_count_tokens_matches_the_prompt(client):
    counted = client.messages.count_tokens(model="tiny", messages=HELLO, system="be brief", tools=[READ_TOOL])
    reply = client.messages.create(
        model="tiny", max_tokens=1, messages=HELLO, system="be brief", tools=[READ_TOOL]
    )
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_models_health_prefix_and_beta(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    info = client.models.retrieve("claude-opus-4-8").model_dump()
    assert info["context_window"] == 2048 and info["max_tokens"] == 256
    with pytest.raises(anthropic.NotFoundError, match="gpt-5"):
        client.models.retrieve("gpt-5")
    assert httpx.head(server.url + "/").status_code == 200
    assert httpx.head(server.url + "/some/prefix/").status_code == 200
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    prefixed = anthropic.Anthropic(base_url=server.url + "/some/prefix", api_key=TOKENS["bob"], max_retries=0)
    reply = prefixed.beta.messages.create(
        model="tiny",
        max_tokens=2,
        messages=HELLO,
        betas=["claude-code-20250219", "interleaved-thinking-2025-05-14"],
    )
    assert reply.usage.output_tokens >= 1


def test_bearer_token_and_metrics(server):
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=TOKENS["bob"], max_retries=0)
    bearer.messages.create(model="tiny", max_tokens=2, messages=HELLO)
    text = httpx.get(server.url + "/metrics", headers={"authorization": "Bearer tok-bob"}).text
    assert 'ikcode_requests_total{route="/v1/messages",status="200"}' in text
    assert re.search(r'ikcode_ttft_seconds_bucket\{cache="(warm|cold)"', text)
    for name in ("ikcode_engine_running", "ikcode_engine_waiting", "ikcode_prompt_tokens_total",
                 'ikcode_cached_tokens_total{tier="device"}', "ikcode_generated_tokens_total",
                 "ikcode_queue_wait_seconds_count", "ikcode_render_segment_hits"):  # fmt: skip
        assert name in text
    assert_error(httpx.get(server.url + "/metrics"), 401, "authentication_error")


def test_request_log_has_numbers_not_prompts(server, client, tmp_path_factory):
    secret = "zebra-violet-quasar"
    client.messages.create(
        model="tiny", max_tokens=3, messages=[{"role": "user", "content": secret}],
        extra_headers={"X-Claude-Code-Session-Id": "sess-42"},
    )  # fmt: skip
    log_path = server.server.config.app.state.gateway.settings.request_log_path
    text = log_path.read_text()
    assert secret not in text and "tok-alice" not in text
    record = [json.loads(line) for line in text.splitlines() if "sess-42" in line][-1]
    keys = "request_id model prompt_tokens cached_tokens_device cached_tokens_host hit_rate queue_wait_ms"
    for key in (keys + " ttft_ms duration_ms output_tokens stop_reason error").split():
        assert key in record
    assert record["user"] == "alice" and record["error"] is None and record["output_tokens"] >= 1


# ---- tool use through the scripted seam ------------------------------------------------------
def test_tool_use_stream_and_round_trip(engine, tokenizer, tmp_path):
    script = tokenizer.encode("Reading it. " + TOOL_CALL) + [tokenizer.token_to_id("<|im_end|>")]
    srv = serve(ScriptedEngine(engine, script), tokenizer, tmp_path)
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key=TOKENS["alice"], max_retries=0)
        with client.messages.stream(
            model="tiny", max_tokens=200, messages=HELLO, tools=[READ_TOOL]
        ) as stream:
            events = list(stream)
            message = stream.get_final_message()
        assert message.stop_reason == "tool_use"
        assert [b.type for b in message.content] == ["text", "tool_use"]
        tool = message.content[1]
        assert (
            tool.name == "Read" and tool.input == {"file_path": "/repo/a.py"} and tool.id.startswith("toolu_")
        )
        assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
        # The client sends the turn back with the result: the generated ids are reused.
        gw = srv.server.config.app.state.gateway
        hits = gw.renderer.store.stats()["reply_hits"]
        follow_up = HELLO + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "x = 1"}],
            },
        ]
        again = client.messages.create(model="tiny", max_tokens=200, messages=follow_up, tools=[READ_TOOL])
        assert gw.renderer.store.stats()["reply_hits"] == hits + 1
        assert again.stop_reason == "tool_use"
    finally:
        srv.stop()
    wait_idle(engine)


def test_stop_sequence_stops_the_engine(engine, tokenizer, tmp_path):
    script = tokenizer.encode("alpha beta ## gamma delta epsilon zeta eta theta")
    srv = serve(ScriptedEngine(engine, script), tokenizer, tmp_path)
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key=TOKENS["alice"], max_retries=0)
        reply = client.messages.create(model="tiny", max_tokens=100, messages=HELLO, stop_sequences=["##"])
        assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "##"
        assert reply.content[0].text == "alpha beta "
    finally:
        srv.stop()
    wait_idle(engine)


def test_ping_while_waiting_for_the_first_token(engine, tokenizer, tmp_path):
    script = tokenizer.encode("ok") + [2]
    srv = serve(ScriptedEngine(engine, script, delay_s=0.5), tokenizer, tmp_path)
    try:
        body = {"model": "tiny", "max_tokens": 10, "messages": HELLO, "stream": True}
        raw = post(srv, body).text
        assert raw.startswith("event: message_start")
        assert raw.count("event: ping") >= 2
        assert raw.rstrip().endswith('data: {"type":"message_stop"}')
    finally:
        srv.stop()
    wait_idle(engine)


def test_disconnect_mid_stream_frees_the_engine(server, engine):
    body = {"model": "tiny", "max_tokens": 256, "messages": HELLO, "stream": True, "temperature": 0}
    # A long reply: ignore EOS by asking for plenty and cutting the connection after two deltas.
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", server.url + "/v1/messages", json=body, headers={"x-api-key": "tok-alice"}
        ) as r:
            seen = 0
            for line in r.iter_lines():
                if line.startswith("event: content_block_delta"):
                    seen += 1
                if seen >= 2 or line.startswith("event: message_stop"):
                    break
    wait_idle(engine)
    gw = server.server.config.app.state.gateway
    deadline = time.monotonic() + 5
    while gw.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gw.in_flight == 0
    last = json.loads(gw.settings.request_log_path.read_text().splitlines()[-1])
    assert last["error"] == "client disconnected" and last["stream"] is True


# ---- errors --------------------------------------------------------------------------------------
def test_authentication_errors(server):
    body = {"model": "tiny", "max_tokens": 2, "messages": HELLO}
    assert_error(post(server, body, key=None), 401, "authentication_error")
    assert_error(post(server, body, key="tok-mallory"), 401, "authentication_error")
    assert post(server, body, key=TOKENS["bob"]).status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=HELLO
        )


def test_refuses_non_loopback_without_tokens(engine, tokenizer):
    with pytest.raises(ValueError, match="non-loopback"):
        create_app(engine, tokenizer, GatewaySettings(served_model="tiny", bind_loopback=False))


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"model": "tiny", "messages": HELLO}, "max_tokens"),
        ({"model": "tiny", "max_tokens": 100000, "messages": HELLO}, "maximum allowed number of output"),
        ({"model": "tiny", "max_tokens": 0, "messages": HELLO}, "max_tokens"),
        ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"model": "tiny", "max_tokens": 5, "messages": []}, "at least one message"),
        ({"model": "tiny", "max_tokens": 5, "messages": HELLO, "temperature": 3}, "temperature"),
        ({"model": "tiny", "max_tokens": 5, "messages": HELLO,
          "output_config": {"format": {"type": "json_schema", "schema": {}}}}, "structured output"),
        ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": "AA"}}]}]}, "image"),
    ],
)  # fmt: skip
def test_invalid_requests(server, body, fragment):
    error = assert_error(post(server, body), 400, "invalid_request_error")
    assert fragment in error["error"]["message"]


def test_invalid_json_and_unknown_routes(server):
    headers = {"x-api-key": "tok-alice", "content-type": "application/json"}
    assert_error(
        httpx.post(server.url + "/v1/messages", content=b"{nope", headers=headers),
        400,
        "invalid_request_error",
    )
    assert_error(
        httpx.post(server.url + "/v1/messages", content=b"[1]", headers=headers), 400, "invalid_request_error"
    )
    assert_error(httpx.get(server.url + "/v1/nothing-here", headers=headers), 404, "not_found_error")
    assert_error(httpx.get(server.url + "/v1/messages", headers=headers), 405, "invalid_request_error")


def test_unknown_model_is_404_naming_it(client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-unknown-9", max_tokens=2, messages=HELLO)
    assert "claude-unknown-9" in caught.value.body["error"]["message"]


def test_prompt_too_long_wording(server, client):
    long_text = "x " * 3000
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": long_text}])
    message = caught.value.body["error"]["message"]
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 2047 maximum", message)


def test_request_too_large(engine, tokenizer, tmp_path):
    srv = serve(engine, tokenizer, tmp_path, max_body_bytes=2000)
    try:
        big = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "y" * 5000}]}
        assert_error(post(srv, big), 413, "request_too_large")

        def chunks():  # no Content-Length: the size is checked as the body streams in
            yield b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"z" * 500
            yield b'"}]}'

        headers = {"x-api-key": "tok-alice", "content-type": "application/json"}
        assert_error(
            httpx.post(srv.url + "/v1/messages", content=chunks(), headers=headers), 413, "request_too_large"
        )
    finally:
        srv.stop()


def test_rate_limited_and_overloaded(engine, tokenizer, tmp_path):
    script = tokenizer.encode("slow answer") + [2]
    srv = serve(ScriptedEngine(engine, script, delay_s=1.0), tokenizer, tmp_path, max_concurrent_requests=1)
    try:
        body = {"model": "tiny", "max_tokens": 10, "messages": HELLO, "stream": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", srv.url + "/v1/messages", json=body, headers={"x-api-key": "tok-alice"}):
                second = post(srv, body)
                assert_error(second, 429, "rate_limit_error")
                assert 1 <= int(second.headers["retry-after"]) <= 60
    finally:
        srv.stop()

    class Overloaded(ScriptedEngine):
        def submit(self, request):
            raise EngineOverloaded("no KV memory for this prompt now", retry_after_s=7)

    srv = serve(Overloaded(engine, []), tokenizer, tmp_path)
    try:
        response = post(srv, {"model": "tiny", "max_tokens": 10, "messages": HELLO})
        assert_error(response, 529, "overloaded_error")
        assert response.headers["retry-after"] == "7"
    finally:
        srv.stop()
    wait_idle(engine)


def test_internal_errors_never_leak(engine, tokenizer, tmp_path):
    class Broken(ScriptedEngine):
        def submit(self, request):
            raise RuntimeError("secret internals /home/user/token")

    srv = serve(Broken(engine, []), tokenizer, tmp_path)
    try:
        response = post(srv, {"model": "tiny", "max_tokens": 10, "messages": HELLO})
        body = assert_error(response, 500, "api_error")
        assert "secret" not in response.text and "Traceback" not in response.text and body
    finally:
        srv.stop()


def test_engine_error_mid_stream_ends_the_stream(engine, tokenizer, tmp_path):
    class FailsAfterOneToken(ScriptedEngine):
        def submit(self, request):
            stream = RequestStream(request.request_id)
            stream.put(TokenEvent(request.request_id, tokenizer.encode("a")))
            from ikcode.engines.base import EngineError

            stream.put(
                TokenEvent(request.request_id, [], True, FinishReason.ERROR, error=EngineError("boom"))
            )
            return stream

    srv = serve(FailsAfterOneToken(engine, []), tokenizer, tmp_path)
    try:
        raw = post(srv, {"model": "tiny", "max_tokens": 10, "messages": HELLO, "stream": True}).text
        assert raw.startswith("event: message_start")
        last = raw.strip().split("\n\n")[-1]
        assert last.startswith("event: error")
        assert json.loads(last.split("data: ", 1)[1])["error"]["type"] == "api_error"
        client = anthropic.Anthropic(base_url=srv.url, api_key="tok-alice", max_retries=0)
        with pytest.raises(anthropic.APIStatusError):
            with client.messages.stream(model="tiny", max_tokens=10, messages=HELLO) as stream:
                list(stream)
    finally:
        srv.stop()


def test_hang_up_before_the_first_event_frees_the_engine(engine, tokenizer, tmp_path):
    # Only the response itself can end the engine request: its body generator never started.
    scripted = ScriptedEngine(engine, tokenizer.encode("ok") * 50, delay_s=0.3)
    app = create_app(scripted, tokenizer, settings(tmp_path))
    body = {"model": "tiny", "max_tokens": 100, "messages": HELLO, "stream": True}
    hang_up_before_the_first_chunk(app, body, TOKENS["alice"])
    gw = app.state.gateway
    assert gw.in_flight == 0
    last = json.loads(gw.settings.request_log_path.read_text().splitlines()[-1])
    assert last["error"] == "client disconnected" and last["stream"] is True
    wait_idle(engine)
