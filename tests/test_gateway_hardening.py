"""The edge against careless and hostile clients, over real HTTP: a request's cost is bounded
before it is paid, sampling values are checked, a non-streaming client that hangs up stops the
engine, /health tells strangers nothing, odd paths and huge strings are handled plainly."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from ikcode.gateway import GatewaySettings, create_app
from ikcode.gateway.server import BackgroundServer
from tests.test_gateway_support import ScriptedEngine, tiny_tokenizer, wait_idle
from tests.tiny_model import tiny_engine

TOKEN = "ik-test-token-0123456789"
HEADERS = {"x-api-key": TOKEN, "content-type": "application/json"}
MODEL = "tiny"
SCRIPT_TOKENS = 1500  # a long answer, so a hang-up lands mid-generation


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    inner = tiny_engine(kv_memory_bytes=4 * 1024 * 1024)
    inner.start()
    log_path = tmp_path_factory.mktemp("hardening") / "requests.jsonl"
    settings = GatewaySettings(
        served_model=MODEL,
        max_output_tokens=SCRIPT_TOKENS,
        default_temperature=0.0,
        auth_tokens={"tester": TOKEN},
        request_log_path=log_path,
    )
    app = create_app(inner, tiny_tokenizer(), settings)
    server = BackgroundServer(app).start()
    yield server, inner, app.state.gateway, log_path
    server.stop()
    inner.shutdown(drain_timeout_s=1)


def post(server, body: bytes | dict, path: str = "/v1/messages", **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=HEADERS, timeout=60, **kwargs)


def message(text: str = "hi", **extra) -> dict:
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}], **extra}


def assert_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text[:300]
    body = response.json()
    assert body["type"] == "error" and isinstance(body["error"]["message"], str)
    return body["error"]["message"]


def log_records(log_path) -> list[dict]:
    return [json.loads(line) for line in log_path.read_text().splitlines()]


# ---- bounded cost: bytes, characters, tokens ---------------------------------------------------
def test_a_30_mb_body_is_refused_by_size_while_a_small_request_is_served(served):
    server, engine, gw, _ = served
    huge = json.dumps(message("x" * (30 * 1024 * 1024))).encode()
    results: dict[str, httpx.Response] = {}

    def send(name: str, content) -> None:
        results[name] = httpx.post(server.url + "/v1/messages", content=content, headers=HEADERS, timeout=120)

    def chunks():
        for start in range(0, len(huge), 1 << 20):
            yield huge[start : start + (1 << 20)]

    threads = [
        threading.Thread(target=send, args=("length", huge)),
        threading.Thread(target=send, args=("chunked", chunks())),
        threading.Thread(target=send, args=("small", json.dumps(message()).encode())),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert gw.body_limit_bytes < len(huge)
    for name in ("length", "chunked"):
        assert "larger than" in assert_error(results[name], 413)
    assert results["small"].status_code == 200
    wait_idle(engine)


def _oversized(where: str, big: str) -> tuple[dict, str]:
    """(a request body carrying `big` in one place of the prompt, the path it is sent to)."""
    tool = {"name": "Read", "description": "read a file", "input_schema": {"type": "object"}}
    if where == "tool description":
        return message(tools=[{**tool, "description": big}]), "/v1/messages"
    if where == "tool parameter description":
        schema = {"type": "object", "properties": {"path": {"type": "string", "description": big}}}
        return message(tools=[{**tool, "input_schema": schema}]), "/v1/messages"
    if where == "tool parameter names":
        names = {f"{n:x}".rjust(64, "p"): {"type": "string"} for n in range(len(big) // 64 + 1)}
        schema = {"type": "object", "properties": names}
        return message(tools=[{**tool, "input_schema": schema}]), "/v1/messages"
    if where == "tool call arguments":
        call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": big}}
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
        messages = [
            {"role": "user", "content": "read it"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]
        return message(tools=[tool], messages=messages), "/v1/messages"
    if where == "loaded deferred tools":  # a schema rendered once per tool_reference naming it
        part = big[: len(big) // 50 + 1]
        schema = {"type": "object", "properties": {"x": {"type": "string", "description": part}}}
        later = {"name": "Later", "description": "later", "input_schema": schema, "defer_loading": True}
        search = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "Later"}}
        found = [{"type": "tool_reference", "tool_name": "Later"}] * 51
        messages = [
            {"role": "user", "content": "find it"},
            {"role": "assistant", "content": [search]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": found}],
            },
        ]
        return message(tools=[tool, later], messages=messages), "/v1/messages"
    if where == "document":
        document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": big}}
        return message([document]), "/v1/messages"
    body = message(big)
    if where == "count_tokens":
        del body["max_tokens"]
        return body, "/v1/messages/count_tokens"
    return body, "/v1/messages"


@pytest.mark.parametrize(
    "where",
    [
        "message text",
        "tool description",
        "tool parameter description",
        "tool parameter names",
        "tool call arguments",
        "loaded deferred tools",
        "document",
        "count_tokens",
    ],
)
def test_a_prompt_over_the_character_bound_is_refused_before_tokenizing(served, where):
    server, engine, gw, _ = served
    renders = []
    render = gw.renderer.render
    gw.renderer.render = lambda *args: renders.append(1) or render(*args)
    try:
        chars = gw.context_window * gw.max_token_chars + 10  # no tokenizer could fit it
        assert chars < gw.body_limit_bytes
        body, path = _oversized(where, "z" * chars)
        text = assert_error(post(server, body, path), 400)
    finally:
        gw.renderer.render = render
    assert text.startswith("prompt is too long: ") and "tokens > " in text  # Claude Code's wording
    assert renders == [], "the prompt was tokenized before its size was checked"


def test_a_deferred_tool_description_is_not_counted(served):
    """A deferred tool stays out of the prompt, so its size is the token check's to judge: a
    request listing one with a huge description is served."""
    server, engine, gw, _ = served
    big = "z" * (gw.context_window * gw.max_token_chars + 10)
    deferred = {"name": "Later", "description": big, "input_schema": {}, "defer_loading": True}
    assert post(server, message(tools=[deferred])).status_code == 200
    wait_idle(engine)


def test_more_stop_sequences_than_a_client_needs_are_a_400(served):
    """Each one is looked for in every piece of text streamed: 60,000 made each token cost 23 ms
    of the event loop every other stream shares."""
    server, engine, gw, _ = served
    text = assert_error(post(server, message(stop_sequences=[f"stop{n}" for n in range(65)])), 400)
    assert text == "stop_sequences: at most 64 are accepted, got 65"
    assert post(server, message(stop_sequences=[f"stop{n}" for n in range(64)])).status_code == 200
    wait_idle(engine)


# ---- sampling values the engine cannot sample from ---------------------------------------------
@pytest.mark.parametrize(
    "field,value", [("temperature", 1e-39), ("temperature", 1e-6), ("top_p", 1e-300), ("top_p", 1e-40)]
)
def test_tiny_sampling_values_are_a_400_not_a_500(served, field, value):
    server, engine, _, _ = served
    text = assert_error(post(server, message(**{field: value})), 400)
    assert field in text
    wait_idle(engine)


def test_zero_and_ordinary_sampling_values_are_served(served):
    server, engine, _, _ = served
    for extra in ({"temperature": 0.0}, {"top_p": 0.0}, {"temperature": 1e-5, "top_p": 1e-5}):
        assert post(server, message(**extra)).status_code == 200, extra
    wait_idle(engine)


# ---- a non-streaming client that hangs up --------------------------------------------------------
def test_non_streaming_hang_up_aborts_the_engine_work(tmp_path):
    inner = tiny_engine(kv_memory_bytes=4 * 1024 * 1024)
    engine = ScriptedEngine(inner, [5] * SCRIPT_TOKENS)
    inner.start()
    log_path = tmp_path / "requests.jsonl"
    settings = GatewaySettings(
        served_model=MODEL, max_output_tokens=SCRIPT_TOKENS, request_log_path=log_path, ping_interval_s=30
    )
    server = BackgroundServer(create_app(engine, tiny_tokenizer(), settings)).start()
    try:
        body = json.dumps(message(max_tokens=SCRIPT_TOKENS)).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(
                b"POST /v1/messages HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            deadline = time.monotonic() + 30
            while inner.load().running == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # generating now
        wait_idle(inner, timeout_s=5)  # the engine stops soon after the hang-up, not after 1,500 tokens
        deadline = time.monotonic() + 5
        while not log_path.exists() or not log_path.read_text().strip():
            assert time.monotonic() < deadline, "no request-log line for the cut request"
            time.sleep(0.02)
        record = log_records(log_path)[-1]
        assert record["error"] == "client disconnected", record
        assert record["output_tokens"] < SCRIPT_TOKENS, record
    finally:
        server.stop()
        inner.shutdown(drain_timeout_s=1)


# ---- /health, paths, echoed strings -----------------------------------------------------------
def test_health_tells_strangers_only_that_it_is_up(served):
    server, _, _, _ = served
    anonymous = httpx.get(server.url + "/health", timeout=10)
    assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}
    wrong = httpx.get(server.url + "/health", headers={"x-api-key": "ik-wrong"}, timeout=10)
    assert wrong.json() == {"status": "ok"}
    details = httpx.get(server.url + "/health", headers=HEADERS, timeout=10).json()
    assert details["status"] == "ok" and "requests" in details and "in_flight" in details


def test_trailing_slash_is_served_in_place_not_redirected(served):
    server, engine, _, _ = served
    response = post(server, message(), path="/v1/messages/", follow_redirects=False)
    assert response.status_code == 200, response.text[:200]
    assert "location" not in response.headers
    other = httpx.get(server.url + "/v1/nothing/", headers=HEADERS, timeout=10, follow_redirects=False)
    assert "location" not in other.headers
    assert_error(other, 404)
    wait_idle(engine)


def test_a_huge_model_string_is_clipped_in_the_answer_and_the_log(served):
    server, _, _, log_path = served
    model = "m" * (512 * 1024)  # under the body limit: the model check itself must clip it
    text = assert_error(post(server, {**message(), "model": model}), 404)
    assert len(text) < 1000
    record = log_records(log_path)[-1]
    assert record["status"] == 404 and len(json.dumps(record)) < 2000


def test_the_request_log_is_rotated_at_its_size_limit(tmp_path):
    from ikcode.gateway.request_log import RequestLog

    log = RequestLog(tmp_path / "requests.jsonl", max_bytes=10_000)
    for i in range(1000):
        log.write({"request_id": i, "pad": "x" * 80})
    log.close()
    current, older = tmp_path / "requests.jsonl", tmp_path / "requests.jsonl.1"
    assert older.exists() and older.stat().st_size <= 10_000 + 200
    assert current.stat().st_size <= 10_000 + 200
    last = json.loads(current.read_text().splitlines()[-1])
    assert last["request_id"] == 999  # the newest lines are kept


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_client_leaving_while_sending_its_body_is_a_499_not_a_500(served, path):
    server, engine, gw, log_path = served
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nx-api-key: {TOKEN}\r\n"
                "content-type: application/json\r\ncontent-length: 1000\r\n\r\n".encode()
                + b'{"model": "tiny", "messages": ['
            )
            time.sleep(0.2)  # the server is waiting for the rest of the body
    deadline = time.monotonic() + 5
    metrics = ""
    while time.monotonic() < deadline:
        metrics = httpx.get(server.url + "/metrics", headers=HEADERS).text
        if f'route="{path}",status="499"' in metrics:
            break
        time.sleep(0.05)
    assert f'route="{path}",status="499"' in metrics
    assert 'status="500"' not in metrics
    # `ikcode status` counts the server's errors apart from the requests it refused.
    health = httpx.get(server.url + "/health", headers=HEADERS).json()
    assert health["errors"] == 0 and health["refused"] > 0
    assert post(server, message()).status_code == 200  # still serving
    wait_idle(engine)


@pytest.mark.parametrize(
    "tools,choice,expected",
    [
        ([], {"type": "any"}, "needs at least one tool"),
        ([], {"type": "tool", "name": "Read"}, "needs at least one tool"),
        (["Read"], {"type": "tool", "name": "Nope"}, "Nope is not one of the request's tools"),
        (["Read"], {"type": "tool", "name": "Read"}, None),
        (["Read"], {"type": "any"}, None),
    ],
)
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_tool_choice_no_answer_could_meet_is_a_400(served, tools, choice, expected, path):
    server, engine, _, _ = served
    listed = [{"name": name, "description": "read", "input_schema": {"type": "object"}} for name in tools]
    body = message(tool_choice=choice, **({"tools": listed} if listed else {}))
    if path.endswith("count_tokens"):
        del body["max_tokens"]
    answer = post(server, body, path)
    if expected is None:
        assert answer.status_code == 200, answer.text[:300]
    else:
        assert expected in assert_error(answer, 400)
    wait_idle(engine)


def test_a_body_that_trickles_in_is_refused_at_its_deadline(monkeypatch):
    """The per-user caps count a request once its body is read: a body that never finishes
    arriving must not hold its connection for ever."""
    from ikcode.gateway import edge

    monkeypatch.setattr(edge, "BODY_READ_TIMEOUT_S", 1.0)
    engine = tiny_engine(kv_memory_bytes=4 * 1024 * 1024)
    engine.start()
    srv = BackgroundServer(create_app(engine, tiny_tokenizer(), GatewaySettings())).start()
    try:
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            head = f"POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            conn.sendall((head + "Content-Length: 1000\r\n\r\n{").encode())
            started = time.monotonic()
            answer = conn.recv(65536).decode()
            elapsed = time.monotonic() - started
            while "invalid_request_error" not in answer and time.monotonic() - started < 5:
                more = conn.recv(65536).decode()  # the head and the body may come apart
                if not more:
                    break
                answer += more
    finally:
        srv.stop()
        engine.shutdown(drain_timeout_s=1)
    assert answer.startswith("HTTP/1.1 400"), answer[:200]
    assert "did not finish arriving within 1 s" in answer and "invalid_request_error" in answer
    assert elapsed < 5, elapsed
