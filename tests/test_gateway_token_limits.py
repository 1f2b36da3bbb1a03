"""One token cannot take a shared server for itself: past its running requests it gets a 429
while others are served, and an exposed server caps each token unless its profile says."""

from __future__ import annotations

import json
import threading
import time

import httpx

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
