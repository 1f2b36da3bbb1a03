"""The gateway's event loop stays free while a DeepInfer rank is busy with a long step.

A rank answers the gateway's calls (cache lookups, the submit's probe) only between its steps,
and on a B200 a 128K-token prefill chunk is a 2.6 s step. Those calls must not run on the event
loop: every other stream, /health and new connections would stop for the whole step. The CPU
engine core here takes 0.8 s a step (IKCODE_DEEPINFER_CPU_STEP_SECONDS)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from ikcode.admission import AdmissionConfig, AdmissionController
from ikcode.gateway import BackgroundServer, GatewaySettings, create_app
from tests.deepinfer_build.cpu_runtime import ENV_STEP_SECONDS
from tests.deepinfer_build.harness import real_engine, wait_quiet
from tests.test_gateway_support import tiny_tokenizer

pytestmark = pytest.mark.deepinfer

STEP_S = 0.8


@pytest.fixture
def server(tmp_path):
    vocab = tiny_tokenizer().vocab_size
    engine = real_engine(
        tmp_path / "di", ranks=1, blocks=256, vocab=vocab, eos=2, environment={ENV_STEP_SECONDS: str(STEP_S)}
    )
    controller = AdmissionController(engine, AdmissionConfig())
    controller.start()
    settings = GatewaySettings(
        served_model="deepseek-v4.1-flash",
        default_temperature=0.0,
        request_log_path=tmp_path / "requests.jsonl",
    )
    srv = BackgroundServer(create_app(controller, tiny_tokenizer(), settings)).start()
    yield srv, engine
    srv.stop()
    controller.shutdown(drain_timeout_s=5)


def _message(url: str, text: str, max_tokens: int, results: list) -> None:
    messages = [{"role": "user", "content": text}]
    body = {"model": "deepseek-v4.1-flash", "max_tokens": max_tokens, "messages": messages}
    results.append(httpx.post(url + "/v1/messages", json=body, timeout=120).status_code)


def test_health_answers_while_a_new_request_waits_for_the_ranks_step(server):
    srv, engine = server
    results: list[int] = []
    # A long answer keeps the rank stepping (0.8 s a step) for the whole test.
    long_answer = threading.Thread(target=_message, args=(srv.url, "keep the rank busy", 14, results))
    long_answer.start()
    time.sleep(3 * STEP_S)
    newcomers = [
        threading.Thread(target=_message, args=(srv.url, f"a new turn {i}", 1, results)) for i in range(3)
    ]
    worst = 0.0
    with httpx.Client(timeout=30) as client:
        for t in newcomers:
            t.start()
        deadline = time.monotonic() + 4 * STEP_S
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            assert client.get(srv.url + "/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.02)
    for t in [long_answer, *newcomers]:
        t.join(timeout=120)
    assert results == [200] * 4
    assert worst < STEP_S / 2, f"/health took {worst:.2f} s while new requests waited for a {STEP_S} s step"
    wait_quiet(engine)
