"""kind = "anthropic": ikcode's upstream front forwarding to a real ikcode server (tiny embedded
engine) over HTTP on 127.0.0.1, through the official SDK."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import pytest

from ikcode.auth import forwarded_session_id, user_session
from ikcode.gateway.server import BackgroundServer
from tests.test_gateway_support import hang_up_before_the_first_chunk
from tests.test_upstream_support import (
    FRONT_TOKEN,
    UPSTREAM_TOKEN,
    EmbeddedReplica,
    front_app,
    front_records,
    front_server,
)

SYSTEM = "You are a careful coding agent. " * 20
SESSION = {
    "X-Claude-Code-Session-Id": "sess-anthropic-1",
    "anthropic-beta": "claude-code-20250219,odd-beta-1",
}


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    rep = EmbeddedReplica(tmp_path_factory.mktemp("up"))
    yield rep
    rep.stop()


@pytest.fixture(scope="module")
def front_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("front")


@pytest.fixture(scope="module")
def front(replica, front_dir):
    srv = front_server(front_dir, "anthropic", [replica.url])
    yield srv
    srv.stop()


def client(url: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, default_headers=SESSION)


def test_create_and_stream_with_cache_reported_by_upstream(front, front_dir, replica):
    sdk = client(front.url, FRONT_TOKEN)
    messages = [{"role": "user", "content": "list the files under src and explain each " * 8}]
    first = sdk.messages.create(model="tiny", max_tokens=8, system=SYSTEM, messages=messages)
    assert first.type == "message" and first.content and first.usage.output_tokens > 0
    messages += [
        {"role": "assistant", "content": first.content[0].text or "ok"},
        {"role": "user", "content": "now the tests"},
    ]
    with sdk.messages.stream(model="tiny", max_tokens=8, system=SYSTEM, messages=messages) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and "content_block_delta" in events and events[-1] == "message_stop"
    assert (
        final.usage.cache_read_input_tokens > 0
    )  # the second turn reads the first from the upstream's cache
    records = front_records(front_dir)[-2:]
    assert [r["stream"] for r in records] == [False, True]
    warm = records[1]
    assert warm["cache_source"] == "reported_by_upstream" and warm["ttft_source"] == "measured_by_ikcode"
    assert warm["cached_tokens"] == final.usage.cache_read_input_tokens
    assert warm["prompt_tokens"] == final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert warm["ttft_ms"] > 0 and warm["replica"] == "r0" and warm["session_id"] == "sess-anthropic-1"
    upstream_seen = replica.records()[-1]
    # The replica knows the front's one token: the session goes there as alice's own (its digest).
    alices = forwarded_session_id(user_session("alice", "sess-anthropic-1"))
    assert upstream_seen["session_id"] == alices and upstream_seen["user"] == "front"
    health = httpx.get(front.url + "/health", headers={"x-api-key": FRONT_TOKEN}).json()
    assert health["engine"] == "upstream" and health["hit_rate_source"] == "reported_by_upstream"
    assert health["requests"] >= 2 and health["errors"] == 0  # answered vs the server's errors
    assert health["cached_tokens_reported_by_upstream"] >= warm["cached_tokens"]


def test_error_bodies_and_unknown_fields_pass_through_unmodified(front, replica):
    # A sampling value the replica refuses (the front does not judge it): its 400 comes back as is.
    hi = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "max_tokens": 4, "temperature": 1e-39, "messages": hi}
    direct = httpx.post(replica.url + "/v1/messages", json=body, headers={"x-api-key": UPSTREAM_TOKEN})
    via = httpx.post(front.url + "/v1/messages", json=body, headers={"x-api-key": FRONT_TOKEN})
    assert via.status_code == direct.status_code == 400
    assert via.content == direct.content  # byte for byte
    assert via.headers.get("x-should-retry") == direct.headers.get("x-should-retry")
    wrong_model = httpx.post(
        front.url + "/v1/messages",
        json=dict(body, model="nope", temperature=0.0),
        headers={"x-api-key": FRONT_TOKEN},
    )
    assert wrong_model.status_code == 404 and "nope" in wrong_model.json()["error"]["message"]
    odd = dict(body, temperature=0.0, some_future_field={"nested": [1, 2]}, context_management={"edits": []})
    ok = httpx.post(front.url + "/v1/messages?beta=true", json=odd, headers={"x-api-key": FRONT_TOKEN})
    assert ok.status_code == 200 and ok.json()["type"] == "message"


def test_max_tokens_over_the_fronts_limit_is_refused_before_forwarding(front, replica):
    seen = len(replica.records())
    body = {"model": "tiny", "max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(front.url + "/v1/messages", json=body, headers={"x-api-key": FRONT_TOKEN})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens: 100000 > 256" in answer.json()["error"]["message"]  # the front's limit
    assert len(replica.records()) == seen  # the replica never saw it
    health = httpx.get(front.url + "/health", headers={"x-api-key": FRONT_TOKEN}).json()
    assert health["refused"] >= 1  # `ikcode status` counts it apart from the server's errors


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"tiny","max_tokens":"100000","messages":[{"role":"user","content":"hi"}]}',
        b'{"model":"tiny","max_tokens":[100000],"messages":[{"role":"user","content":"hi"}]}',
        b'{"model":"tiny","messages":[{"role":"user","content":"hi"}]}',
        # parsed here as its last value (5), read upstream perhaps as its first
        b'{"model":"tiny","max_tokens":100000,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]}',
    ],
    ids=["string", "list", "absent", "twice"],
)
def test_a_max_tokens_the_front_cannot_bound_is_refused_before_forwarding(front, replica, raw):
    """An upstream may coerce "100000" to a number, or take the first of two keys: what the front
    cannot read as one whole number it refuses, or the reply's cost went unbounded."""
    seen = len(replica.records())
    headers = {"x-api-key": FRONT_TOKEN, "content-type": "application/json"}
    answer = httpx.post(front.url + "/v1/messages", content=raw, headers=headers)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"
    message = answer.json()["error"]["message"]
    assert "max_tokens: a whole number is required" in message or "appears twice" in message  # the front's
    assert len(replica.records()) == seen


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize(
    "raw",
    [
        # json.loads refuses a number of more than 4,300 digits: the body went on unchecked,
        # max_tokens 100,000,000 and admission skipped
        b'{"model":"tiny","max_tokens":100000000,"metadata":{"pad":' + b"9" * 5000 + b'},"messages":[]}',
        b"[" * 200_000,  # a RecursionError: a 500 and a traceback in the log, every request
        b"not json",
        b'["a list"]',
    ],
    ids=["huge-number", "nested", "not-json", "not-an-object"],
)
def test_a_body_the_front_cannot_read_is_its_own_400(front, replica, raw, path):
    """What the front cannot parse it cannot bound: a 400 from the front, nothing forwarded."""

    def replica_requests() -> float:  # every request the replica answered, refused ones too
        text = httpx.get(replica.url + "/metrics", headers={"x-api-key": UPSTREAM_TOKEN}).text
        counted = [line for line in text.splitlines() if line.startswith('ikcode_requests_total{route="/v1/')]
        return sum(float(line.split()[-1]) for line in counted)

    before = replica_requests()
    headers = {"x-api-key": FRONT_TOKEN, "content-type": "application/json"}
    answer = httpx.post(front.url + path, content=raw, headers=headers)
    assert answer.status_code == 400, answer.text[:300]
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("request body "), error
    assert replica_requests() == before  # the front's own answer, nothing forwarded


def test_health_tells_strangers_only_the_status_and_never_shows_credentials(tmp_path):
    srv = front_server(tmp_path, "anthropic", ["http://svc:s3cret-pass@127.0.0.1:9/v1?key=k3y"])
    try:
        stranger = httpx.get(srv.url + "/health")
        assert stranger.status_code == 200 and set(stranger.json()) == {"status"}
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        httpx.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": FRONT_TOKEN})  # fails: 503
        known = httpx.get(srv.url + "/health", headers={"x-api-key": FRONT_TOKEN})
        assert known.json()["replicas"][0]["url"] == "http://127.0.0.1:9/v1"
        metrics = httpx.get(srv.url + "/metrics", headers={"x-api-key": FRONT_TOKEN}).text
        for text in (known.text, metrics):
            assert "s3cret" not in text and "k3y" not in text
    finally:
        srv.stop()


def test_count_tokens_forwarded_and_auth_is_the_fronts(front, replica):
    body = {"model": "tiny", "system": SYSTEM, "messages": [{"role": "user", "content": "count me"}]}
    direct = httpx.post(
        replica.url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": UPSTREAM_TOKEN}
    )
    via = httpx.post(front.url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": FRONT_TOKEN})
    assert via.status_code == 200 and via.json() == direct.json() and via.json()["input_tokens"] > 20
    # The upstream's token does not open the front, and no token at all is a 401 in Anthropic's shape.
    denied = httpx.post(
        front.url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": UPSTREAM_TOKEN}
    )
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    models = httpx.get(front.url + "/v1/models", headers={"x-api-key": FRONT_TOKEN}).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["context_window"] == 2048


def test_no_healthy_replica_is_a_retryable_503(tmp_path):
    srv = front_server(tmp_path, "anthropic", ["http://127.0.0.1:9"])  # nothing listens on port 9
    try:
        body = {
            "model": "tiny",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
        }
        answer = httpx.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": FRONT_TOKEN})
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "overloaded_error"
        assert answer.headers["retry-after"] == "2" and answer.headers["x-should-retry"] == "true"
        metrics = httpx.get(srv.url + "/metrics", headers={"x-api-key": FRONT_TOKEN}).text
        assert 'ikcode_replica_healthy{replica="r0",url="http://127.0.0.1:9"} 0.0' in metrics
        assert json.loads(front_records(tmp_path)[-1]["error"])["error"]["type"] == "overloaded_error"
    finally:
        srv.stop()


def test_hang_up_before_the_first_chunk_releases_the_replica(replica, tmp_path):
    # The relay generator never starts: the response must still close the upstream stream,
    # free the replica's slot and its admission place, and log the request.
    app = front_app(tmp_path, "anthropic", [replica.url])
    body = {"model": "tiny", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    hang_up_before_the_first_chunk(app, body, FRONT_TOKEN)
    up = app.state.upstream
    assert [r["in_flight"] for r in up.router.snapshot()] == [0]
    assert up.in_flight == 0
    record = front_records(tmp_path)[-1]
    assert record["error"] == "client disconnected" and record["replica"]
    assert up.admission is not None
    assert [s["inflight_prefills"] for s in up.admission.stats().values()] == [0]


def test_a_relayed_stream_counts_as_in_flight_until_it_ends(front, replica, monkeypatch):
    # The replica's engine thread is held before its first token, so the stream is certainly
    # still open upstream while the front is asked (a fast tiny model could otherwise finish first).
    gate = threading.Event()
    append_token = replica.engine._append_token

    def held_append_token(seq, token):
        assert gate.wait(30)
        append_token(seq, token)

    monkeypatch.setattr(replica.engine, "_append_token", held_append_token)
    headers = {"x-api-key": FRONT_TOKEN, "anthropic-version": "2023-06-01"}
    body = {
        "model": "tiny",
        "max_tokens": 16,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with httpx.Client(timeout=60, headers={"x-api-key": FRONT_TOKEN}) as http:
        assert http.get(front.url + "/health").json()["in_flight"] == 0
        with http.stream("POST", front.url + "/v1/messages", json=body, headers=headers) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("event: message_start"))
            try:
                assert http.get(front.url + "/health").json()["in_flight"] == 1  # still streaming
            finally:
                gate.set()
            rest = list(lines)
        assert any(line.startswith("event: message_stop") for line in rest)
        deadline = time.monotonic() + 5
        while http.get(front.url + "/health").json()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert http.get(front.url + "/health").json()["in_flight"] == 0


def test_a_token_past_its_running_requests_gets_a_429_at_the_front(replica, tmp_path, monkeypatch):
    gate = threading.Event()
    append_token = replica.engine._append_token

    def held_append_token(seq, token):  # the replica's answer stays open until the gate opens
        assert gate.wait(30)
        append_token(seq, token)

    monkeypatch.setattr(replica.engine, "_append_token", held_append_token)
    app = front_app(tmp_path, "anthropic", [replica.url])
    up = app.state.upstream
    up.settings.max_requests_per_user = 1
    srv = BackgroundServer(app).start()
    body = {"model": "tiny", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": FRONT_TOKEN}
    try:
        with httpx.Client(timeout=60, headers=headers) as http:
            with http.stream("POST", srv.url + "/v1/messages", json=body) as first:
                assert first.status_code == 200 and up.in_flight_by_user["alice"] == 1
                second = http.post(srv.url + "/v1/messages", json=body)
                assert second.status_code == 429 and second.headers["retry-after"] == "1"
                assert "limit 1" in second.json()["error"]["message"]
                gate.set()
                assert "event: message_stop" in first.read().decode()
        deadline = time.monotonic() + 5
        while up.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert up.in_flight == 0 and not up.in_flight_by_user  # the refused one took nothing
    finally:
        gate.set()
        srv.stop()


def test_several_users_on_an_anthropic_upstream_share_its_cache_only_when_told(tmp_path):
    # The Messages API has no cache salt: with several users the front refuses to start unless
    # the profile says the upstream's cache is theirs to share.
    users = {"alice": FRONT_TOKEN, "bob": "bob-token"}
    with pytest.raises(ValueError, match="salt_per_user = false"):
        front_app(tmp_path, "anthropic", ["http://127.0.0.1:9"], settings={"auth_tokens": users})
    shared = {"auth_tokens": users, "cache_salt_per_user": False}
    assert front_app(tmp_path, "anthropic", ["http://127.0.0.1:9"], settings=shared) is not None


def test_a_browser_clients_origin_stays_at_the_front(tmp_path):
    """A front that requires tokens serves a browser-based client (its requests carry an Origin);
    a loopback replica without tokens refuses foreign Origins (same_machine.py), so the front,
    having applied its own policy, does not pass the Origin (or Referer) on."""
    open_replica = EmbeddedReplica(tmp_path, name="open", auth_tokens={})
    srv = front_server(tmp_path, "anthropic", [open_replica.url], token=None)
    try:
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        page = {"x-api-key": FRONT_TOKEN, "origin": "https://app.example", "referer": "https://app.example/"}
        answer = httpx.post(srv.url + "/v1/messages", json=body, headers=page, timeout=30)
        assert answer.status_code == 200, answer.text
    finally:
        srv.stop()
        open_replica.stop()


def test_a_session_id_is_its_users_own_when_the_cache_is_shared(tmp_path, replica):
    """With one cache for all (salt_per_user = false), a session is still its user's own in
    routing and admission: bob sending alice's session id neither moves it nor takes its slot."""
    users = {"alice": FRONT_TOKEN, "bob": "ik-bob-0123456789"}
    settings = {"auth_tokens": users, "cache_salt_per_user": False}
    app = front_app(tmp_path, "anthropic", [replica.url], settings=settings)
    srv = BackgroundServer(app).start()
    try:
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for token in users.values():
            headers = {"x-api-key": token, "x-claude-code-session-id": "s-1"}
            answer = httpx.post(srv.url + "/v1/messages", json=body, headers=headers, timeout=60)
            assert answer.status_code == 200, answer.text
        up = app.state.upstream
        own = sorted(user_session(name, "s-1") for name in users)
        assert sorted(up.router.session_replica) == own and len(own) == 2
        # The replica, which knows only the front's token, is given each user's own session too
        # (the same id for each of a user's turns), never the id as it came.
        headers = {"x-api-key": FRONT_TOKEN, "x-claude-code-session-id": "s-1"}
        assert httpx.post(srv.url + "/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
        seen = [r["session_id"] for r in replica.records()[-3:]]
        assert seen[0] == seen[2] != seen[1] and "s-1" not in seen, seen
    finally:
        srv.stop()
