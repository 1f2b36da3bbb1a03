"""The upstream front when its client or its replica stops answering: a client that hangs up on a
whole (non-streamed) answer stops the replica's work, a silent replica is a 504 in the client's
shape, and count_tokens is held to the per-user cap like any request that costs upstream work."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from tests.test_upstream_support import (
    FRONT_TOKEN,
    UPSTREAM_TOKEN,
    EmbeddedReplica,
    front_records,
    front_server,
)


def _slow_replica(tmp_path, monkeypatch, delay_s: float) -> EmbeddedReplica:
    """A replica whose engine takes delay_s per generated token."""
    replica = EmbeddedReplica(tmp_path)
    append_token = replica.engine._append_token

    def slow_append(seq, token):
        time.sleep(delay_s)
        append_token(seq, token)

    monkeypatch.setattr(replica.engine, "_append_token", slow_append)
    return replica


def _replica_in_flight(replica: EmbeddedReplica) -> int:
    return httpx.get(replica.url + "/health", headers={"x-api-key": UPSTREAM_TOKEN}).json()["in_flight"]


def _send_then_hang_up(url: str, body: dict, after_s: float) -> None:
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as conn:
        head = "POST /v1/messages HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        head += f"x-api-key: {FRONT_TOKEN}\r\ncontent-length: {len(raw)}\r\n\r\n"
        conn.sendall(head.encode() + raw)
        time.sleep(after_s)


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_a_client_that_hangs_up_on_a_whole_answer_stops_the_replica(tmp_path, monkeypatch):
    replica = _slow_replica(tmp_path, monkeypatch, 0.5)  # 200 tokens: ~100 s of work
    front = front_server(tmp_path, "anthropic", [replica.url])
    try:
        body = {"model": "tiny", "max_tokens": 200, "messages": [{"role": "user", "content": "hello there"}]}
        _send_then_hang_up(front.url, body, 0.5)
        assert _wait_for(lambda: _replica_in_flight(replica) == 0), "the replica works for a client that left"
        assert _wait_for(lambda: front_records(tmp_path) != [])
        [record] = front_records(tmp_path)
        assert record["status"] == 499 and "client disconnected" in record["error"]
        health = httpx.get(front.url + "/health", headers={"x-api-key": FRONT_TOKEN}).json()
        assert health["in_flight"] == 0 and health["replicas"][0]["in_flight"] == 0
    finally:
        front.stop()
        replica.stop()


def test_a_silent_replica_is_a_504_in_the_clients_shape_and_logged(tmp_path, monkeypatch):
    replica = _slow_replica(tmp_path, monkeypatch, 0.3)
    front = front_server(tmp_path, "anthropic", [replica.url], read_timeout_s=1.0)
    try:
        body = {"model": "tiny", "max_tokens": 50, "messages": [{"role": "user", "content": "hello there"}]}
        headers = {"x-api-key": FRONT_TOKEN}
        reply = httpx.post(front.url + "/v1/messages", json=body, headers=headers, timeout=60)
        assert reply.status_code == 504
        assert reply.json()["error"]["message"] == "the upstream server did not answer within 1 s"
        [record] = front_records(tmp_path)
        assert record["status"] == 504 and "did not answer" in record["error"]
    finally:
        front.stop()
        replica.stop()


def test_count_tokens_is_held_to_the_per_user_cap(tmp_path, monkeypatch):
    replica = _slow_replica(tmp_path, monkeypatch, 0.2)
    front = front_server(tmp_path, "anthropic", [replica.url], settings={"max_requests_per_user": 1})
    headers = {"x-api-key": FRONT_TOKEN}
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "max_tokens": 30, "stream": True, "messages": messages}
    count = {"model": "tiny", "messages": [{"role": "user", "content": "how many tokens is this"}]}
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", front.url + "/v1/messages", json=body, headers=headers, timeout=60) as r:
            for _ in r.iter_lines():
                started.set()

    runner = threading.Thread(target=stream)
    runner.start()
    try:
        assert started.wait(30)
        busy = httpx.post(front.url + "/v1/messages/count_tokens", json=count, headers=headers, timeout=30)
        assert busy.status_code == 429, busy.text
        runner.join(60)
        free = httpx.post(front.url + "/v1/messages/count_tokens", json=count, headers=headers, timeout=30)
        assert free.status_code == 200 and free.json()["input_tokens"] > 0
    finally:
        runner.join(60)
        front.stop()
        replica.stop()
