"""A request head must arrive within HEAD_READ_TIMEOUT_S (here 1 s): a client that trickles its
headers, or opens a connection and sends nothing, is cut off; a request whose head came in time
is left alone however slowly its body follows (edge.py has that deadline) or its answer streams.
Real server over HTTP, raw sockets for the slow clients."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from ikcode.gateway import GatewaySettings, create_app, head_deadline
from ikcode.gateway.server import BackgroundServer
from tests.test_gateway_support import tiny_tokenizer
from tests.tiny_model import tiny_engine

MODEL = "tiny"
DEADLINE_S = 1.0
REQUEST = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture()
def server(monkeypatch):
    monkeypatch.setattr(head_deadline, "HEAD_READ_TIMEOUT_S", DEADLINE_S)
    engine = tiny_engine(kv_memory_bytes=2 * 1024 * 1024)
    app = create_app(engine, tiny_tokenizer(), GatewaySettings(served_model=MODEL, default_temperature=0.0))
    background = BackgroundServer(app).start()
    yield background
    background.stop()
    engine.shutdown(drain_timeout_s=1)


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(0.2)
    return sock


def _closed_after(sock: socket.socket, trickle: bytes | None, limit_s: float = 6.0) -> float | None:
    """Seconds until the server closes sock (sending `trickle` every 0.2 s meanwhile), None if it
    is still open after limit_s."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        try:
            if trickle:
                sock.sendall(trickle)
            if sock.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - started
    return None


def test_a_trickled_request_head_is_cut_off(server):
    sock = _connect(server)
    sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    closed = _closed_after(sock, b"x-slow: 1\r\n")  # a header line every 0.2 s, never the blank line
    sock.close()
    assert closed is not None and closed < DEADLINE_S + 2, closed


def test_a_silent_connection_is_cut_off(server):
    sock = _connect(server)
    closed = _closed_after(sock, None)
    sock.close()
    assert closed is not None and closed < DEADLINE_S + 2, closed


def test_a_request_whose_head_came_in_time_may_send_its_body_slowly(server):
    body = json.dumps(REQUEST).encode()
    head = (
        f"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(head)
    started = time.monotonic()
    for i in range(0, len(body), max(1, len(body) // 12)):  # ~2.5 s of body: past the head deadline
        sock.sendall(body[i : i + max(1, len(body) // 12)])
        time.sleep(0.2)
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    sock.close()
    assert time.monotonic() - started > DEADLINE_S * 2
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_keep_alive_clients_are_answered_turn_after_turn(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for pause in (0.0, 0.5, 1.5):  # the last outlives the deadline: a fresh connection serves it
            time.sleep(pause)
            reply = client.post("/v1/messages", json=REQUEST)
            assert reply.status_code == 200
