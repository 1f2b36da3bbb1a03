"""One token cannot take a shared server for itself: past its running requests it gets a 429
while others are served, and an exposed server caps each token unless its profile says."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from ikcode.auth import OWNER
from ikcode.gateway import GatewaySettings, create_app
from ikcode.gateway.server import BackgroundServer
from tests.test_gateway_hardening import MODEL, assert_error, message
from tests.test_gateway_support import tiny_tokenizer
from tests.tiny_model import tiny_engine


def test_a_token_past_its_running_requests_gets_a_429_and_others_are_served(tmp_path):
    inner = tiny_engine(kv_memory_bytes=4 * 1024 * 1024)
    gate = threading.Event()
    append_token = inner._append_token

    def held_append_token(seq, token):  # requests stay running until the gate opens
        assert gate.wait(30)
        append_token(seq, token)

    inner._append_token = held_append_token
    inner.start()
    tokens = {"alice": "ik-alice-0123456789", "bob": "ik-bob-0123456789", OWNER: "ik-owner-0123456789"}
    settings = GatewaySettings(served_model=MODEL, auth_tokens=tokens, max_requests_per_user=2)
    app = create_app(inner, tiny_tokenizer(), settings)
    gw = app.state.gateway
    server = BackgroundServer(app).start()
    statuses: list[tuple[str, int]] = []

    def send(user: str) -> None:
        headers = {"x-api-key": tokens[user], "content-type": "application/json"}
        body = json.dumps(message(max_tokens=2)).encode()
        answer = httpx.post(server.url + "/v1/messages", content=body, headers=headers, timeout=60)
        statuses.append((user, answer.status_code))

    def wait_for(user: str, running: int) -> None:
        deadline = time.monotonic() + 20
        while gw.in_flight_by_user[user] < running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gw.in_flight_by_user[user] == running

    threads = [threading.Thread(target=send, args=("alice",)) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        wait_for("alice", 2)
        third = httpx.post(
            server.url + "/v1/messages",
            content=json.dumps(message()).encode(),
            headers={"x-api-key": tokens["alice"], "content-type": "application/json"},
        )
        assert "limit 2" in assert_error(third, 429) and third.headers["retry-after"] == "1"
        threads.append(threading.Thread(target=send, args=("bob",)))
        threads[-1].start()
        wait_for("bob", 1)  # bob's request runs beside alice's two
        threads += [threading.Thread(target=send, args=(OWNER,)) for _ in range(3)]
        for thread in threads[-3:]:
            thread.start()
        wait_for(OWNER, 3)  # the server's own token is not capped
    finally:
        gate.set()
        for thread in threads:
            thread.join(30)
        server.stop()
        inner.shutdown(drain_timeout_s=1)
    assert sorted(statuses) == sorted([("alice", 200), ("alice", 200), ("bob", 200)] + [(OWNER, 200)] * 3)
    assert not gw.in_flight_by_user  # every count went back to zero


def test_an_exposed_server_limits_each_token_unless_the_profile_says(tmp_path):
    from ikcode.profiles import load_profile, shipped_profiles_dir
    from ikcode.stack import EXPOSED_REQUESTS_PER_USER, gateway_settings

    local = load_profile("local")
    assert gateway_settings(local, "127.0.0.1", 8192).max_requests_per_user is None
    assert gateway_settings(local, "0.0.0.0", 8192).max_requests_per_user == EXPOSED_REQUESTS_PER_USER
    text = (shipped_profiles_dir() / "local.toml").read_text()
    own = tmp_path / "own.toml"
    own.write_text(text.replace("[auth]\n", "[auth]\nmax_requests_per_user = 3\n"))
    assert gateway_settings(load_profile(str(own)), "0.0.0.0", 8192).max_requests_per_user == 3


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_tokens_requests_past_its_cap_are_refused_before_they_are_tokenized(path):
    """The slot is taken before the prompt is tokenized: four requests of one token at once all
    tokenized their prompts (count_tokens was not capped at all) before the cap turned three
    away, so a large prompt sent many times at once cost many tokenizations."""
    inner = tiny_engine(kv_memory_bytes=4 * 1024 * 1024)
    inner.start()
    token = "ik-alice-0123456789"
    settings = GatewaySettings(served_model=MODEL, auth_tokens={"alice": token}, max_requests_per_user=1)
    app = create_app(inner, tiny_tokenizer(), settings)
    renderer = app.state.gateway.renderer
    render, renders = renderer.render, []
    renderer.render = lambda *args, **kw: renders.append(1) or time.sleep(0.5) or render(*args, **kw)
    server = BackgroundServer(app).start()
    body = message() if path == "/v1/messages" else {k: v for k, v in message().items() if k != "max_tokens"}
    statuses: list[int] = []

    def send() -> None:
        headers = {"x-api-key": token, "content-type": "application/json"}
        answer = httpx.post(server.url + path, content=json.dumps(body).encode(), headers=headers, timeout=60)
        statuses.append(answer.status_code)

    threads = [threading.Thread(target=send) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        server.stop()
        inner.shutdown(drain_timeout_s=1)
    assert sorted(statuses) == [200, 429, 429, 429]
    assert len(renders) == 1
    assert not app.state.gateway.in_flight_by_user  # every slot given back
