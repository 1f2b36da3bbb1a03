"""The background server's log stays bounded, and a crash's traceback still lands in it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

from ikcode import server_log

SERVER = textwrap.dedent(
    """
    import logging, sys
    from ikcode import server_log
    server_log.configure(max_bytes=4000)
    log = logging.getLogger("ikcode.gateway")
    for i in range(400):
        log.warning("request %d failed: the client went away", i)
    print("a line on stdout after the rollovers", flush=True)
    raise RuntimeError("the engine thread crashed")
    """
)


def test_server_log_rotates_and_keeps_stderr_on_the_current_file(tmp_path):
    path = tmp_path / "server.log"
    path.write_text("==== starting ====\n")  # what daemon.start_background writes first
    env = {**os.environ, server_log.ENV_VAR: str(path)}
    with path.open("ab") as out:  # as start_background spawns it: stdout and stderr on the log
        done = subprocess.run(
            [sys.executable, "-c", SERVER], stdout=out, stderr=subprocess.STDOUT, env=env, timeout=60
        )
    assert done.returncode == 1
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["server.log", "server.log.1"]  # two files at most, whatever was logged
    assert path.stat().st_size < 8000 and (tmp_path / "server.log.1").stat().st_size < 8000
    current = path.read_text()
    assert "request 399 failed" in current  # the newest lines are in the file a user opens
    assert "a line on stdout after the rollovers" in current
    assert "RuntimeError: the engine thread crashed" in current  # the traceback followed the file
    for p in tmp_path.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600


def test_without_the_variable_logs_go_to_stderr(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != server_log.ENV_VAR}
    done = subprocess.run(
        [sys.executable, "-c", SERVER], capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path
    )
    assert "request 399 failed" in done.stderr
    assert list(tmp_path.iterdir()) == []
