"""Shutdown: SIGTERM drains for the timeout `ikcode down --timeout` wrote, then every request still
running is answered in Anthropic's shape and logged, and the process leaves without tracebacks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx

from ikcode import daemon
from tests.serving import free_port

ROOT = Path(__file__).resolve().parent.parent
LONG = 1900  # tokens: far longer than the drain timeout lets a request run

SERVER = textwrap.dedent(
    """
    import sys
    import time
    from pathlib import Path
    from ikcode import daemon
    from ikcode.gateway import GatewaySettings, create_app
    from ikcode.gateway.server import run_server
    from tests.test_gateway_support import ScriptedEngine, tiny_tokenizer
    from tests.tiny_model import tiny_engine

    inner = tiny_engine(kv_memory_bytes=4 * 1024 * 1024)
    inner.start()
    engine = ScriptedEngine(inner, [5] * LONG, pace_s=0.01)  # >= 19 s of tokens
    submit_delay_s = float(sys.argv[3])
    if submit_delay_s:  # a submit that waits on the engine (a busy rank), past the drain deadline
        submit = engine.submit
        engine.submit = lambda request: (time.sleep(submit_delay_s), submit(request))[1]
    settings = GatewaySettings(served_model="tiny", max_output_tokens=LONG,
                               request_log_path=Path(sys.argv[2]), ping_interval_s=0.5)
    app = create_app(engine, tiny_tokenizer(), settings)
    try:
        run_server(app, "127.0.0.1", int(sys.argv[1]), log_level="info",
                   drain_timeout_s=lambda: daemon.read_drain_timeout(30.0))
    finally:
        inner.shutdown(drain_timeout_s=5)
    print("server exited cleanly", flush=True)
    """
).replace("LONG", str(LONG))


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("the test server did not start")


def _start(tmp_path: Path, submit_delay_s: float = 0.0) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log_path = tmp_path / "requests.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port), str(log_path), str(submit_delay_s)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return proc, f"http://127.0.0.1:{port}", log_path


def test_sigterm_drains_for_the_given_timeout_then_answers_every_cut_request(tmp_path):
    proc, url, log_path = _start(tmp_path)
    try:
        _wait_healthy(url, proc)
        body = {"model": "tiny", "max_tokens": LONG, "messages": [{"role": "user", "content": "hi"}]}
        answers: dict[str, object] = {}

        def plain() -> None:
            answers["plain"] = httpx.post(url + "/v1/messages", json=body, timeout=60)

        def streamed() -> None:
            answers["stream"] = httpx.post(url + "/v1/messages", json={**body, "stream": True}, timeout=60)

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health", timeout=5).json()["in_flight"] < 2:  # both generating
            assert time.monotonic() < deadline, "the two requests never started"
            time.sleep(0.05)
        time.sleep(0.3)
        daemon.write_drain_timeout(1.0)  # what `ikcode down --timeout 1` does before its SIGTERM
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        answered_s = time.monotonic() - signalled
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The timeout given was honoured (not a fixed 30 s) and nobody waited for 1,900 tokens.
    assert answered_s < 15, answered_s
    plain_answer = answers["plain"]
    assert plain_answer.status_code == 529, output[-3000:]
    assert plain_answer.json()["type"] == "error"
    assert plain_answer.json()["error"]["type"] == "overloaded_error"
    stream_text = answers["stream"].text
    assert "event: error" in stream_text and "overloaded_error" in stream_text
    assert "message_stop" not in stream_text
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert len(records) == 2 and all(r["error"] == "engine is shutting down" for r in records), records
    assert all(r["output_tokens"] < LONG for r in records)
    assert proc.returncode == 0, output
    assert "server exited cleanly" in output
    for bad in ("Traceback", "CancelledError", "SystemExit"):
        assert bad not in output, output


def test_a_request_still_in_its_submit_at_the_deadline_is_cut_when_it_gets_there(tmp_path):
    """The drain cuts the generations it can see; one whose submit was still waiting on the
    engine when the deadline passed is cut as soon as the submit returns, not left generating
    until uvicorn drops its connection."""
    proc, url, log_path = _start(tmp_path, submit_delay_s=3.0)
    try:
        _wait_healthy(url, proc)
        body = {"model": "tiny", "max_tokens": LONG, "messages": [{"role": "user", "content": "hi"}]}
        answers: dict[str, httpx.Response] = {}
        thread = threading.Thread(
            target=lambda: answers.update(plain=httpx.post(url + "/v1/messages", json=body, timeout=60))
        )
        thread.start()
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health", timeout=5).json()["in_flight"] < 1:  # in its submit
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        daemon.write_drain_timeout(0.5)
        proc.send_signal(signal.SIGTERM)
        thread.join(60)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    answer = answers["plain"]
    assert answer.status_code == 529 and answer.json()["error"]["type"] == "overloaded_error", output[-3000:]
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert len(records) == 1 and records[0]["error"] == "engine is shutting down", records
    assert "still open after the cut" not in output, output
    assert proc.returncode == 0 and "server exited cleanly" in output, output
