"""The gateway's errors and guards: Anthropic's error shapes and status codes, auth, size and
rate limits, and failures that must not leak internals or leave a stream unfinished."""

# ruff: noqa: F811 (the pytest fixtures imported from test_gateway_api_support are test arguments)
from __future__ import annotations

import json
import re
import threading
import time

import anthropic
import httpx
import pytest

from ikcode.engines.base import EngineOverloaded, FinishReason, LifecycleKind, RequestStream, TokenEvent
from ikcode.gateway import GatewaySettings, create_app
from tests.test_gateway_api_support import (  # noqa: F401 (engine, server, ...: fixtures)
    HELLO,
    READ_TOOL,
    TOKENS,
    assert_error,
    client,
    engine,
    post,
    serve,
    server,
    tokenizer,
)
from tests.test_gateway_support import ScriptedEngine, wait_idle


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
        # An engine takes top_k as an int32: refused here, not passed on to overflow there.
        ({"model": "tiny", "max_tokens": 5, "messages": HELLO, "top_k": 2**40}, "top_k"),
    ],
)  # fmt: skip
def test_invalid_requests(server, body, fragment):
    error = assert_error(post(server, body), 400, "invalid_request_error")
    assert fragment in error["error"]["message"]


def test_an_error_does_not_echo_a_long_string_of_the_clients_whole(server):
    content = [{"type": "x" * 5000, "text": "hi"}]
    body = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": content}]}
    error = assert_error(post(server, body), 400, "invalid_request_error")
    assert len(error["error"]["message"]) < 1500, len(error["error"]["message"])


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


def test_the_concurrency_cap_holds_while_a_submit_waits_on_the_engine(engine, tokenizer, tmp_path):
    """A submit may wait on the engine (a DeepInfer rank answers between steps): the request
    counts against max_concurrent_requests from before that wait, or all three passed the cap.
    A refused submit gives its place back."""

    class SlowSubmit(ScriptedEngine):
        def submit(self, request):
            time.sleep(0.5)
            if request.sampling.max_tokens == 3:
                raise EngineOverloaded("no KV memory for this prompt now", retry_after_s=1)
            return super().submit(request)

    script = tokenizer.encode("ok") + [2]
    srv = serve(SlowSubmit(engine, script), tokenizer, tmp_path, max_concurrent_requests=1)
    codes: list[int] = []
    try:
        body = {"model": "tiny", "max_tokens": 10, "messages": HELLO}
        send = lambda: codes.append(post(srv, body).status_code)  # noqa: E731
        threads = [threading.Thread(target=send) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(codes) == [200, 429, 429], codes
        assert post(srv, {**body, "max_tokens": 3}).status_code == 529
        assert post(srv, body).status_code == 200  # the refused one's place was given back
        health = httpx.get(srv.url + "/health", headers={"x-api-key": "tok-alice"}, timeout=10).json()
        assert health["in_flight"] == 0
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


def test_a_reply_cut_by_a_stop_sequence_is_rendered_next_turn_as_the_client_got_it(
    engine, tokenizer, tmp_path
):
    """The gateway remembers a reply's generated ids to render it back exactly; a reply cut at a
    stop sequence was generated past the cut, and those ids put the stop text the client never
    got into the next turn's prompt."""
    script = tokenizer.encode("alpha beta gamma delta epsilon") + [2]
    srv = serve(ScriptedEngine(engine, script), tokenizer, tmp_path)
    question = [{"role": "user", "content": "say some greek letters"}]
    try:
        reply = post(
            srv, {"model": "tiny", "max_tokens": 20, "messages": question, "stop_sequences": ["gamma"]}
        )
        assert reply.status_code == 200 and reply.json()["stop_reason"] == "stop_sequence"
        cut = reply.json()["content"][0]["text"]
        assert "gamma" not in cut
        turn = [*question, {"role": "assistant", "content": cut}, {"role": "user", "content": "go on"}]
        counted = post(srv, {"model": "tiny", "messages": turn}, path="/v1/messages/count_tokens").json()
    finally:
        srv.stop()
    wait_idle(engine)
    fresh = serve(ScriptedEngine(engine, script), tokenizer, tmp_path / "fresh")  # never saw the reply
    try:
        expected = post(fresh, {"model": "tiny", "messages": turn}, path="/v1/messages/count_tokens").json()
    finally:
        fresh.stop()
    assert counted["input_tokens"] == expected["input_tokens"]


def test_a_stop_sequence_after_a_stray_tool_call_marker_stops_generation(engine, tokenizer, tmp_path):
    """Text after a <tool_call> that is no call was held by the tool parser until the end, so a
    stop sequence in it stopped nothing: the engine generated up to max_tokens for a reply
    already over. Now the gateway aborts the generation at the stop sequence."""
    script = tokenizer.encode("Hi <tool_call> no json STOP" + " and more" * 100)[:250]
    scripted = ScriptedEngine(engine, script, pace_s=0.002)
    srv = serve(scripted, tokenizer, tmp_path)
    try:
        body = {"model": "tiny", "max_tokens": 256, "messages": HELLO, "stop_sequences": ["STOP"]}
        reply = post(srv, {**body, "tools": [READ_TOOL]}).json()  # tools: the tool parser reads it
    finally:
        srv.stop()
    wait_idle(engine)
    # Without the stop the script runs to its end (shorter than max_tokens): no abort.
    assert reply["stop_reason"] == "stop_sequence" and reply["stop_sequence"] == "STOP"
    assert reply["content"] == [{"type": "text", "text": "Hi <tool_call> no json "}]
    assert len(scripted._aborted) == 1  # the gateway stopped the engine's work


def _prompt_of(srv, tokens: int) -> list[dict]:
    """A one-message conversation whose prompt is exactly `tokens` tokens (" the" is one token)."""
    text = "x"
    for _ in range(2):  # the count of the text's own tokens, then the exact length
        messages = [{"role": "user", "content": text}]
        counted = post(srv, {"model": "tiny", "messages": messages}, path="/v1/messages/count_tokens").json()
        text += " the" * (tokens - counted["input_tokens"])
    return [{"role": "user", "content": text}]


def _whole_and_streamed(srv, body: dict) -> tuple[dict, str]:
    """The same request answered whole (its JSON) and streamed (its SSE text)."""
    return post(srv, body).json(), post(srv, {**body, "stream": True}).text


def test_a_reply_cut_by_the_context_window_says_so(engine, tokenizer, tmp_path):
    """The window, not max_tokens, ended the reply: the API's model_context_window_exceeded, as
    Claude Code reads it ("the model has reached its context window limit"), not max_tokens
    (which has it tell the user to raise CLAUDE_CODE_MAX_OUTPUT_TOKENS). Streamed or not."""
    script = tokenizer.encode(" and more" * 100)
    srv = serve(ScriptedEngine(engine, script), tokenizer, tmp_path)
    try:
        window = engine.info.context_window
        near_the_end = _prompt_of(srv, window - 5)
        whole, streamed = _whole_and_streamed(
            srv, {"model": "tiny", "max_tokens": 100, "messages": near_the_end}
        )
    finally:
        srv.stop()
    wait_idle(engine)
    assert whole["stop_reason"] == "model_context_window_exceeded", whole
    assert whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"] == window - 5
    assert whole["usage"]["output_tokens"] == 5
    assert '"stop_reason":"model_context_window_exceeded"' in streamed.replace(" ", "")


def _whole_and_streamed_text(engine, tokenizer, tmp_path, script: list[int]) -> tuple[str, str]:
    srv = serve(ScriptedEngine(engine, script), tokenizer, tmp_path)
    try:
        whole, streamed = _whole_and_streamed(srv, {"model": "tiny", "max_tokens": 20, "messages": HELLO})
    finally:
        srv.stop()
    wait_idle(engine)
    deltas = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: ")]
    text = "".join(d["delta"].get("text", "") for d in deltas if d["type"] == "content_block_delta")
    return whole["content"][0]["text"], text


def test_a_reply_cut_inside_a_character_ends_before_it(engine, tokenizer, tmp_path):
    """max_tokens can end a reply between the bytes of one character: its text stops before that
    character instead of ending in U+FFFD, streamed or not."""
    script = tokenizer.encode("ok 😀")[:-1]  # the last byte of the emoji never comes
    whole, streamed = _whole_and_streamed_text(engine, tokenizer, tmp_path, script)
    assert whole in ("ok ", "ok") and streamed in ("ok ", "ok")


def test_a_replacement_character_the_model_wrote_last_is_kept(engine, tokenizer, tmp_path):
    """U+FFFD is a character like any other: a reply that ends in one (the model wrote its three
    bytes) keeps it, streamed or not. Telling it from a cut character by its text alone dropped it."""
    script = tokenizer.encode("ok \ufffd")
    assert _whole_and_streamed_text(engine, tokenizer, tmp_path, script) == ("ok \ufffd", "ok \ufffd")


@pytest.mark.parametrize("stream", [True, False])
def test_an_engine_stopping_mid_reply_is_an_error_not_a_finished_answer(tokenizer, tmp_path, stream):
    """The engine ends a request it did not finish with ABORT (shutting down, or its thread gone):
    the gateway read only ERROR as a failure, so the cut reply went out as end_turn (a 200 the
    client took as final), was logged without an error and remembered as the turn."""
    from tests.tiny_model import tiny_engine

    inner = tiny_engine(kv_memory_bytes=2 * 1024 * 1024)
    inner.start()

    def stop_at_first_token(event) -> None:  # the engine has its other 499 tokens to go
        if event.kind is LifecycleKind.FIRST_TOKEN:
            threading.Thread(target=inner.shutdown, kwargs={"drain_timeout_s": 0}).start()

    inner.add_listener(stop_at_first_token)
    srv = serve(ScriptedEngine(inner, tokenizer.encode("word " * 100), pace_s=0.05), tokenizer, tmp_path)
    try:
        answer = post(srv, {"model": "tiny", "max_tokens": 200, "messages": HELLO, "stream": stream})
    finally:
        srv.stop()
    if stream:
        last = answer.text.strip().split("\n\n")[-1]
        assert last.startswith("event: error"), answer.text[-300:]
        assert json.loads(last.split("data: ", 1)[1])["error"]["type"] == "overloaded_error"
    else:
        assert answer.status_code == 529, answer.text
    (record,) = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert record["error"] and record["stop_reason"] is None


def test_a_bug_while_collecting_a_whole_answer_is_logged_as_one(engine, tokenizer, tmp_path, monkeypatch):
    """It was logged "client disconnected" (the error left unset), sending doctor's and a reader's
    attention to the client."""
    from ikcode.gateway import reply_builder

    def broken(self, token_ids):
        raise RuntimeError("a bug")

    monkeypatch.setattr(reply_builder.ReplyBuilder, "push", broken)
    srv = serve(ScriptedEngine(engine, tokenizer.encode("ok")), tokenizer, tmp_path)
    try:
        answer = post(srv, {"model": "tiny", "max_tokens": 10, "messages": HELLO})
    finally:
        srv.stop()
    assert answer.status_code == 500
    (record,) = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert record["error"] == "internal error"
    wait_idle(engine)
