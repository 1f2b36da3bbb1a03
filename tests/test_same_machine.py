"""A loopback server without tokens answers only this machine: a web page's request (its own
Host after DNS rebinding, or its Origin) gets a 403 in Anthropic's shape and never reaches the
engine, while Claude Code's and the SDK's requests pass. Real server over HTTP, tiny engine."""

from __future__ import annotations

import socket

import anthropic
import httpx
import pytest

from ikcode.gateway import GatewaySettings, create_app
from ikcode.gateway.same_machine import foreign_request
from ikcode.gateway.server import BackgroundServer
from tests.test_gateway_support import tiny_tokenizer
from tests.tiny_model import tiny_engine

MODEL = "tiny"
BODY = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}


def _server(**settings):
    engine = tiny_engine(kv_memory_bytes=2 * 1024 * 1024)
    app = create_app(
        engine, tiny_tokenizer(), GatewaySettings(served_model=MODEL, default_temperature=0.0, **settings)
    )
    return BackgroundServer(app).start(), engine


@pytest.fixture(scope="module")
def loopback():
    background, engine = _server()
    yield background, engine
    background.stop()
    engine.shutdown(drain_timeout_s=1)


def test_clients_on_this_machine_are_answered(loopback):
    background, _ = loopback
    sdk = anthropic.Anthropic(base_url=background.url, api_key="unused", max_retries=0)
    assert sdk.messages.create(**BODY).usage.output_tokens >= 1
    localhost = f"http://localhost:{background.port}"
    assert httpx.post(f"{localhost}/v1/messages", json=BODY, timeout=30).status_code == 200
    # A page served from this machine (a local dev server) is this machine too.
    origin = {"origin": "http://localhost:3000"}
    page = httpx.post(f"{background.url}/v1/messages", json=BODY, headers=origin, timeout=30)
    assert page.status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {"host": "rebound.example.com"},  # DNS rebinding: the page's own name, pointed at 127.0.0.1
        {"origin": "https://evil.example"},  # a cross-site page's POST
        {"origin": "null"},  # a sandboxed frame or a file:// page
        {"host": "127.0.0.1.evil.example:8080"},
        {"host": "[evil]"},  # unparseable: refused, not a 500
        {"origin": "http://["},
    ],
)
def test_a_web_page_is_refused_before_the_engine(loopback, headers):
    background, engine = loopback
    steps = engine.steps
    # text/plain: a body a cross-site page may send without a CORS preflight.
    response = httpx.post(
        f"{background.url}/v1/messages",
        content=httpx.Request("POST", "http://x", json=BODY).content,
        headers={"content-type": "text/plain", **headers},
        timeout=30,
    )
    assert response.status_code == 403, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "permission_error"
    assert "loopback" in error["error"]["message"]
    assert engine.steps == steps  # nothing ran for it
    for path in ("/health", "/metrics", "/v1/models"):  # nor does it read the server's figures
        assert httpx.get(f"{background.url}{path}", headers=headers, timeout=30).status_code == 403


@pytest.mark.parametrize("bind_loopback", [False, True])
def test_a_server_with_tokens_leaves_it_to_them(bind_loopback):
    """Bound beyond loopback, or behind a reverse proxy on this machine that passes on its public
    Host, names other than this machine's are how clients reach it: the token decides (a 401
    without one, a 200 with it), not the Host."""
    background, engine = _server(auth_tokens={"alice": "ik-alice-0123456789"}, bind_loopback=bind_loopback)
    try:
        url, far = f"{background.url}/v1/messages", {"host": "gpu-box.internal:8080"}
        assert httpx.post(url, json=BODY, headers=far, timeout=30).status_code == 401
        with_token = {**far, "x-api-key": "ik-alice-0123456789"}
        assert httpx.post(url, json=BODY, headers=with_token, timeout=30).status_code == 200
    finally:
        background.stop()
        engine.shutdown(drain_timeout_s=1)


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:8080",
        "localhost",
        "LOCALHOST.:80",
        "[::1]:8080",
        "127.0.0.2",
        "app.localhost:1",
        "0.0.0.0:8080",  # reaches a loopback listener on Linux and macOS
        "[::]:8080",
    ],
)
def test_names_of_this_machine(host):
    assert foreign_request([(b"host", host.encode())]) is None


def test_this_machines_own_name_is_this_machine():
    assert foreign_request([(b"host", f"{socket.gethostname()}:8080".encode())]) is None
