"""An upstream front on its way down drains like the gateway: SIGTERM lets the streams it relays
finish (up to the drain timeout), refuses new requests with 529 meanwhile, then exits. It was cut
after uvicorn's fixed few seconds, the client getting a broken stream."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serving import free_port
from tests.test_upstream_stream_faults import BLOCK, DELTA, START, ScriptedReplica, _anthropic
from tests.test_upstream_support import FRONT_TOKEN

pytestmark = pytest.mark.slow

FRONT = """
import sys
from pathlib import Path
from ikcode.gateway.server import run_server
from tests.test_upstream_support import front_app
app = front_app(Path(sys.argv[1]), "anthropic", [sys.argv[2]])
run_server(app, "127.0.0.1", int(sys.argv[3]), log_level="warning", drain_timeout_s=lambda: 30.0)
"""
BODY = {"model": "tiny", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def test_sigterm_lets_a_relayed_stream_finish(tmp_path):
    stop = _anthropic("message_stop", {"type": "message_stop"})
    replica = ScriptedReplica([START, BLOCK] + [DELTA] * 16 + [stop], clean=True, pause_s=0.5)  # ~9 s
    port = free_port()
    root = Path(__file__).resolve().parent.parent
    front = subprocess.Popen([sys.executable, "-c", FRONT, str(tmp_path), replica.url, str(port)], cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if (
                    httpx.get(url + "/health", headers={"x-api-key": FRONT_TOKEN}, timeout=2).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        events: list[dict] = []
        started = threading.Event()

        def client() -> None:
            with httpx.stream(
                "POST", url + "/v1/messages", json=BODY, headers={"x-api-key": FRONT_TOKEN}, timeout=60
            ) as answer:
                for line in answer.iter_lines():
                    if line.startswith("data:"):
                        events.append(json.loads(line[5:]))
                        started.set()

        reader = threading.Thread(target=client)
        reader.start()
        assert started.wait(30)
        front.send_signal(signal.SIGTERM)
        reader.join(60)
        assert front.wait(60) == 0
    finally:
        if front.poll() is None:
            front.kill()
        replica.close()
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "message_stop", kinds[-3:]
    assert kinds.count("content_block_delta") == 16
