"""The gateway's API contract over the real embedded engine (tiny random model), through the
official SDK, on a real uvicorn server on 127.0.0.1: answers, streams, tools, the cache, the
request log, and a client that leaves. Errors and security: test_gateway_errors.py."""

# ruff: noqa: F811 (the pytest fixtures imported from test_gateway_api_support are test arguments)
from __future__ import annotations

import json
import re
import time

import anthropic
import httpx
import pytest

from ikcode.gateway import create_app
from tests.test_gateway_api_support import (  # noqa: F401 (engine, server, ...: fixtures)
    HELLO,
    READ_TOOL,
    TOKENS,
    TOOL_CALL,
    assert_error,
    assert_tool_result_reuses_the_reply,
    client,
    engine,
    post,
    serve,
    server,
    settings,
    tokenizer,
)
from tests.test_gateway_support import ScriptedEngine, hang_up_before_the_first_chunk, wait_idle


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
    # A profile's path_prefix: `ikcode up` waits on {base_url}/health (it waited 600 s on a 404).
    assert httpx.get(server.url + "/some/prefix/health").json()["status"] == "ok"
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
        assert_tool_result_reuses_the_reply(client, gw, HELLO, message, tool, [READ_TOOL])
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


def test_a_special_token_the_model_writes_is_not_shown_as_text(engine, tokenizer, tmp_path):
    """A control token mid-reply (not a stop token, not a marker of the tool format) is left out
    of the text, as vLLM and llama.cpp leave it: shown as `<|im_start|>`, the client sent it back
    as text, tokenized as plain characters, and the conversation's cache missed from there."""
    start = tokenizer.token_to_id("<|im_start|>")
    script = tokenizer.encode("Sure") + [start] + tokenizer.encode("user thanks")
    srv = serve(ScriptedEngine(engine, script + [tokenizer.token_to_id("<|im_end|>")]), tokenizer, tmp_path)
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key=TOKENS["alice"], max_retries=0)
        reply = client.messages.create(model="tiny", max_tokens=100, messages=HELLO)
        assert reply.content[0].text == "Sureuser thanks"
        with client.messages.stream(model="tiny", max_tokens=100, messages=HELLO) as stream:
            assert "".join(stream.text_stream) == "Sureuser thanks"
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


def test_ping_while_the_engine_works_on_what_shows_nothing_yet(engine, tokenizer, tmp_path):
    """Tokens that make no event yet (whitespace here; hidden reasoning, a tool argument held
    whole) reset the wait for the next engine event, and no ping went out: 3 s of silence on a
    0.1 s ping interval, which a proxy's idle timeout cuts."""
    script = tokenizer.encode(" " * 30) + tokenizer.encode("ok")
    srv = serve(ScriptedEngine(engine, script, pace_s=0.05), tokenizer, tmp_path)
    try:
        body = {"model": "tiny", "max_tokens": 64, "messages": HELLO, "stream": True}
        raw = post(srv, body).text
        before_text = raw.split("content_block_start", 1)[0]
        assert before_text.count("event: ping") >= 5, raw[:600]
        assert raw.rstrip().endswith('data: {"type":"message_stop"}')
    finally:
        srv.stop()
    wait_idle(engine)


def test_disconnect_mid_stream_frees_the_engine(engine, tokenizer, tmp_path):
    # A scripted reply of 256 tokens with EOS ignored: the stream is certainly still running when
    # the client cuts the connection after two deltas (a random tiny model may stop early by itself,
    # and on a loaded machine a short reply could finish before the client hangs up).
    srv = serve(ScriptedEngine(engine, tokenizer.encode("ok") * 256), tokenizer, tmp_path)
    body = {"model": "tiny", "max_tokens": 256, "messages": HELLO, "stream": True, "temperature": 0}
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream(
                "POST", srv.url + "/v1/messages", json=body, headers={"x-api-key": "tok-alice"}
            ) as r:
                seen = 0
                for line in r.iter_lines():
                    if line.startswith("event: content_block_delta"):
                        seen += 1
                    if seen >= 2:
                        break
        wait_idle(engine)
        gw = srv.server.config.app.state.gateway
        deadline = time.monotonic() + 5
        while gw.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gw.in_flight == 0
        last = json.loads(gw.settings.request_log_path.read_text().splitlines()[-1])
        assert last["error"] == "client disconnected" and last["stream"] is True
        assert last["output_tokens"] < 256
        # `ikcode status` counts it as a client that left, not as an answered request.
        health = httpx.get(srv.url + "/health", headers={"x-api-key": "tok-alice"}).json()
        assert (health["requests"], health["refused"]) == (0, 1)
    finally:
        srv.stop()
    wait_idle(engine)


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
