"""Process control that cannot hurt a bystander: `ikcode down` signals only the server it started,
a bind failure says what is wrong, `--host` reaches the background child, token names are real."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from ikcode import auth, daemon
from ikcode.cli import serve
from ikcode.profiles import load_profile
from tests.serving import free_port, ikcode


@pytest.fixture
def stranger():
    """A live process that has nothing to do with ikcode (what a reused pid points at)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait(10)


def _state_for(pid: int, identity: str | None) -> daemon.ServerState:
    return daemon.ServerState(pid, "127.0.0.1", 1, "http://127.0.0.1:1", "local", "x.log", 0.0, identity)


def test_down_never_signals_a_process_that_reused_the_servers_pid(stranger):
    # The server crashed; its pid now belongs to another program (started later: another identity).
    daemon.write_state(_state_for(stranger.pid, "ticks:1"))
    assert daemon.process_identity(stranger.pid) not in (None, "ticks:1")
    result = ikcode("down", "--timeout", "1")
    assert result.returncode == 0 and "not running" in result.stdout, result.stdout + result.stderr
    time.sleep(0.2)
    assert stranger.poll() is None, "ikcode down signalled an unrelated process"
    assert not daemon.state_file().exists()  # the stale file is gone
    status = ikcode("status")
    assert status.returncode == 3 and "not running" in status.stdout


def test_an_old_state_file_without_identity_only_matches_an_ikcode_process(stranger):
    daemon.write_state(_state_for(stranger.pid, None))
    assert daemon.read_state() is None
    assert daemon.stop(timeout_s=1) is None
    assert stranger.poll() is None


def test_the_recorded_identity_matches_the_live_process(stranger):
    state = _state_for(stranger.pid, daemon.process_identity(stranger.pid))
    assert daemon.is_our_server(state)
    daemon.write_state(state)
    assert daemon.read_state() == state


def test_an_unassignable_address_is_not_reported_as_a_busy_port():
    port = free_port()
    problem = daemon.bind_problem("192.0.2.1", port)  # TEST-NET-1: never this machine's address
    assert problem is not None and "not assigned to this machine" in problem
    assert "in use" not in problem
    with pytest.raises(daemon.DaemonError, match="not assigned"):
        daemon.check_can_start("192.0.2.1", port)


def test_host_override_reaches_the_background_child(monkeypatch):
    seen: dict = {}

    def fake_start(args, host, port, url, profile, timeout_s=600.0, on_progress=None):
        seen.update(args=args, host=host, timeout_s=timeout_s)
        return _state_for(1, None)

    monkeypatch.setattr(daemon, "start_background", fake_start)
    profile = load_profile("local")
    profile = profile.model_copy(update={"endpoint": profile.endpoint.model_copy(update={"host": "0.0.0.0"})})
    serve.start_stack(profile, port=free_port())
    args = seen["args"]
    assert seen["host"] == "0.0.0.0"
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert seen["timeout_s"] == 600.0


@pytest.mark.parametrize("name", ["", " ", "launcher", "a\nb", "x" * 65, " alice"])
def test_a_token_name_must_be_a_real_name(name):
    with pytest.raises(ValueError):
        auth.add_team_token(name)
    result = ikcode("token", "--add", name)
    assert result.returncode != 0
    assert auth.team_tokens() == {}


def test_adding_a_name_twice_is_refused_and_the_first_token_stays():
    first = ikcode("token", "--add", "bob")
    assert first.returncode == 0 and "restart it to apply" in first.stderr
    token = first.stdout.strip()
    assert auth.team_tokens() == {"bob": token}  # stdout is the token alone
    again = ikcode("token", "--add", "bob")
    assert again.returncode != 0 and "exists" in again.stderr and "--revoke bob" in again.stderr
    assert auth.team_tokens() == {"bob": token}


def test_claude_does_not_hand_its_token_to_a_server_it_did_not_start(tmp_path):
    """On a shared machine the profile's port may be another user's ikcode, or any program: it
    answered /health, so the launcher sent it this user's token and the session's prompts."""
    import http.server
    import os
    import shutil
    import threading

    from tests.serving import local_profile

    seen: list[str] = []

    class Squatter(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append(self.headers.get("authorization", "") + self.headers.get("x-api-key", ""))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    port = free_port()
    squatter = http.server.ThreadingHTTPServer(("127.0.0.1", port), Squatter)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    try:
        env = dict(os.environ, IKCODE_CLAUDE_BIN=shutil.which("true") or "/bin/true")
        profile = str(local_profile(tmp_path, port))
        launched = ikcode("claude", "--profile", profile, "--", "-p", "hi", env=env)
    finally:
        squatter.shutdown()
        squatter.server_close()
    assert launched.returncode != 0
    assert "something other than this user's ikcode answers" in launched.stderr
    token = auth.load_or_create_token()
    assert not any(token in header for header in seen)


def test_down_when_the_server_exits_on_its_own_meanwhile(monkeypatch, stranger):
    """`ikcode down` raced the server's own exit (at the SIGKILL deadline, or a server already
    stopping): os.kill raised ProcessLookupError and down ended in a traceback."""
    stranger.kill()
    stranger.wait(10)
    state = _state_for(stranger.pid, None)
    monkeypatch.setattr(daemon, "read_state", lambda clean_stale=True: state)
    monkeypatch.setattr(daemon, "is_our_server", lambda s: True)
    assert daemon.stop(timeout_s=0) is state


def test_down_kills_the_servers_whole_group_when_it_will_not_stop(monkeypatch):
    """A server that ignores SIGTERM past the deadline is killed with the processes it started
    (an engine's workers would keep the GPUs): it leads its own session, as `ikcode up` starts it."""
    script = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print(worker.pid, flush=True); time.sleep(120)"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    worker = int(server.stdout.readline())
    state = _state_for(server.pid, None)
    monkeypatch.setattr(daemon, "read_state", lambda clean_stale=True: state)
    monkeypatch.setattr(daemon, "is_our_server", lambda s: server.poll() is None)
    monkeypatch.setattr(daemon, "STOP_GRACE_S", 0.5)
    try:
        daemon.stop(timeout_s=0)
        server.wait(10)
        deadline = time.monotonic() + 10
        while daemon.pid_alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not daemon.pid_alive(worker)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)


def test_up_waits_as_long_as_a_deepinfer_profiles_ranks_may_load():
    """`ikcode up` stopped the server at a fixed 10 minutes while its ranks were still within the
    profile's own rank_start_timeout_s."""
    from ikcode.cli.serve import start_timeout_s

    assert start_timeout_s(load_profile("local")) == 600.0
    deepinfer = load_profile("deepinfer-4xb200")
    slow = deepinfer.model_copy(update={"deepinfer": {**deepinfer.deepinfer, "rank_start_timeout_s": 1800}})
    assert start_timeout_s(slow) == 1920.0
    # ... and the adapter takes the same key (it refused it: "unknown [deepinfer] keys").
    from ikcode.engines.deepinfer.config import DeepInferConfig

    watched = {**slow.deepinfer, "hung_rank_s": 120}
    config = DeepInferConfig.from_profile(slow.model_copy(update={"deepinfer": watched}), model_path="/m")
    assert (config.rank_start_timeout_s, config.hung_rank_s) == (1800.0, 120.0)
