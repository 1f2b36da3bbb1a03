"""`ikcode up`, `status`, `logs`, `down` as a user runs them, on the default model."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ikcode import auth, daemon
from tests.serving import free_port, ikcode, local_profile

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_up_status_logs_down_and_refusals(tmp_path):
    port = free_port()
    profile = local_profile(tmp_path, port)
    started = ikcode("up", "--profile", str(profile))
    assert started.returncode == 0, started.stderr
    url = f"http://127.0.0.1:{port}"
    assert url in started.stdout
    try:
        again = ikcode("up", "--profile", str(profile))
        assert again.returncode != 0
        assert "already running" in again.stderr

        token = auth.load_or_create_token()
        unauthorized = httpx.post(f"{url}/v1/messages", json={}, timeout=30)
        assert unauthorized.status_code == 401
        reply = httpx.post(
            f"{url}/v1/messages",
            headers={"Authorization": f"Bearer {token}", "anthropic-version": "2023-06-01"},
            json={
                "model": "smollm2-135m-instruct",
                "max_tokens": 8,
                "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            },
            timeout=120,
        )
        assert reply.status_code == 200, reply.text

        status = ikcode("status", "--json")
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert report["running"] and report["url"] == url
        assert report["model"] == "smollm2-135m-instruct"
        assert report["requests"] == 1 and report["prompt_tokens"] > 0

        logs = ikcode("logs", "-n", "200")
        assert "serving smollm2-135m-instruct" in logs.stdout
        assert token not in logs.stdout
        request_lines = ikcode("logs", "--requests").stdout.strip().splitlines()
        assert json.loads(request_lines[-1])["model"] == "smollm2-135m-instruct"
        assert "capital" not in "".join(request_lines)  # no prompt text in the log
    finally:
        stopped = ikcode("down")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    status = ikcode("status")
    assert status.returncode == 3 and "not running" in status.stdout
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)


def test_port_taken_is_refused_clearly(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = ikcode("up", "--profile", str(local_profile(tmp_path, port)))
    assert result.returncode != 0
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
    assert daemon.read_state() is None


def test_stale_pid_file_is_cleaned_up():
    daemon.write_state(
        daemon.ServerState(2**22 + 12345, "127.0.0.1", 1, "http://127.0.0.1:1", "local", "x.log", 0.0)
    )
    result = ikcode("status")
    assert result.returncode == 3 and "not running" in result.stdout
    assert not daemon.state_file().exists()


def test_health_check_ignores_proxy_variables(monkeypatch):
    from fastapi import FastAPI

    from ikcode.gateway.server import BackgroundServer

    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    server = BackgroundServer(app).start()
    try:
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
            monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        assert daemon.health(server.url) == {"status": "ok"}
    finally:
        server.stop()


def test_a_failed_start_shows_its_own_errors_not_an_earlier_starts(tmp_path):
    profile = local_profile(tmp_path, free_port())
    first = ikcode("up", "--profile", str(profile), "--model", str(tmp_path / "first-missing.gguf"))
    assert first.returncode != 0 and "first-missing.gguf" in first.stderr
    second = ikcode("up", "--profile", str(profile), "--model", str(tmp_path / "second-missing.gguf"))
    assert second.returncode != 0 and "second-missing.gguf" in second.stderr
    assert "first-missing.gguf" not in second.stderr  # the log holds both starts; only this one shows


def test_two_launchers_at_once_share_one_server_and_env_follows_it(tmp_path):
    # Two `ikcode claude` started together with no server up used to both start one (one failed);
    # `ikcode env` and `settings` pointed at the profile's port after `up --port N`; and a proxy
    # in the shell carried requests for this machine's server off to the proxy.
    profile = str(local_profile(tmp_path, free_port()))
    env = dict(os.environ, IKCODE_CLAUDE_BIN=shutil.which("true") or "/bin/true")
    launches = [
        subprocess.Popen(
            [sys.executable, "-m", "ikcode", "claude", "--profile", profile, "--", "-p", "hi"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    try:
        outcomes = [(p.wait(300), p.stderr.read()) for p in launches]
        assert [rc for rc, _ in outcomes] == [0, 0], outcomes
        assert sum("ikcode: serving" in err for _, err in outcomes) == 1  # one started it
    finally:
        ikcode("down")
    port = free_port()
    started = ikcode("up", "--profile", profile, "--port", str(port))
    assert started.returncode == 0, started.stderr
    try:
        proxied = dict(os.environ, HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
        proxied.pop("NO_PROXY", None)
        proxied.pop("no_proxy", None)
        exported = ikcode("env", "--profile", profile, "--shell", "bash", env=proxied).stdout
        assert f"ANTHROPIC_BASE_URL=http://127.0.0.1:{port}" in exported.replace("'", "")
        assert "NO_PROXY=127.0.0.1,localhost" in exported.replace("'", "")
        checked = ikcode("doctor", "--only", "endpoint", "--json", env=proxied)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        ikcode("down")


def test_ctrl_c_while_the_server_loads_stops_it(tmp_path):
    # The child runs in a session of its own: interrupting `ikcode up` left it loading, then serving.
    profile = str(local_profile(tmp_path, free_port()))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ikcode", "up", "--profile", profile],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while daemon.read_state() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        state = daemon.read_state()
        assert state is not None, "the server was never started"
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(60) != 0
        deadline = time.monotonic() + 30
        while daemon.pid_alive(state.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not daemon.pid_alive(state.pid), "the server went on after its launcher was interrupted"
        assert daemon.read_state() is None
    finally:
        launcher.kill()
        ikcode("down")


def test_up_in_the_foreground_takes_the_start_lock(tmp_path):
    """Run by hand, `ikcode up --foreground` checks for a running server and claims the state
    file under the launchers' start lock: while another start holds it, it waits; the server
    that start claimed meanwhile is then found, and this one refuses instead of loading a model
    for the same state file (two at once both passed the check, and the second overwrote the
    first's state, leaving it out of reach of `ikcode down`)."""
    port = free_port()
    profile = str(local_profile(tmp_path, port))
    with daemon.start_lock():
        by_hand = subprocess.Popen(
            [sys.executable, "-m", "ikcode", "up", "--foreground", "--profile", profile],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(3)  # ample for it to reach the check (it imports, reads the profile, no model yet)
        assert by_hand.poll() is None and daemon.read_state() is None, "it did not wait for the lock"
        claimed = daemon.ServerState(
            os.getpid(), "127.0.0.1", port, f"http://127.0.0.1:{port}", "other", "", time.time(),
            daemon.process_identity(os.getpid()),
        )  # fmt: skip
        daemon.write_state(claimed)  # what the lock's holder does before it lets go
    try:
        _, err = by_hand.communicate(timeout=60)
        assert by_hand.returncode != 0 and f"ikcode is already running (pid {os.getpid()})" in err, err
        assert daemon.read_state(clean_stale=False) == claimed
    finally:
        by_hand.kill()
        daemon.clear_state(os.getpid())


def test_a_server_ikcode_up_spawned_does_not_wait_for_the_lock_its_launcher_holds(tmp_path):
    """`ikcode up` holds the start lock until the server it spawned answers, and writes the state
    file only after the spawn: a child that looked for its own pid there (and not finding it yet,
    waited for the lock) hung the start for its 600 s timeout."""
    port = free_port()
    profile = str(local_profile(tmp_path, port))
    env = dict(os.environ, **{daemon.SPAWNED_ENV: str(os.getpid())})
    with daemon.start_lock():  # the launcher's, held; no state written yet
        child = subprocess.Popen(
            [sys.executable, "-m", "ikcode", "up", "--foreground", "--profile", profile],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while daemon.read_state() is None and time.monotonic() < deadline:
                assert child.poll() is None, "the server exited"
                time.sleep(0.1)
            state = daemon.read_state()
            assert state is not None and state.pid == child.pid, "it waited for the launcher's lock"
        finally:
            child.terminate()
            child.wait(30)
            daemon.clear_state(child.pid)
