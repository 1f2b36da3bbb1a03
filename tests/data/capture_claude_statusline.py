"""Record the JSON Claude Code writes to its statusLine command: tests/data/claude-statusline.json.

Run: .venv/bin/python -m tests.data.capture_claude_statusline [path/to/claude]

The status line runs only in the interactive client, so it runs in a pseudo-terminal, with the
launcher's environment and settings plus a statusLine command that saves its stdin, against the
loopback recorder; one prompt is typed, and the last saved input is kept (paths made fixed).
"""

from __future__ import annotations

import json
import os
import pty
import select
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

from ikcode.launcher.rolemap import claude_env
from tests.recorder import Recorder

SERVED = "smollm2-135m-instruct"
OWN_VARS = ("ANTHROPIC_", "CLAUDE")  # the user's own client settings stay out
OUT = Path(__file__).with_name("claude-statusline.json")


def _pump(fd: int, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                os.read(fd, 65536)
            except OSError:
                return


def capture(claude: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        home, project, saved = Path(tmp, "home"), Path(tmp, "project"), Path(tmp, "saved")
        for folder in (home, project, saved):
            folder.mkdir()
        trust = {"hasCompletedOnboarding": True, "projects": {str(project): {"hasTrustDialogAccepted": True}}}
        (home / ".claude.json").write_text(json.dumps(trust))
        with Recorder() as recorder:
            mapping = claude_env(
                served_model=SERVED, base_url=recorder.url, token="recorded", context_window=8192,
                max_output_tokens=1024,
            )  # fmt: skip
            command = f"cat > {shlex.quote(str(saved))}/$(date +%s%N).json; echo ok"
            settings = {
                "env": mapping.set,
                "modelOverrides": mapping.model_overrides,
                "statusLine": {"type": "command", "command": command},
            }
            Path(tmp, "settings.json").write_text(json.dumps(settings))
            env = mapping.apply({k: v for k, v in os.environ.items() if not k.startswith(OWN_VARS)})
            env.update(HOME=str(home), TERM="xterm-256color")
            pid, fd = pty.fork()
            if pid == 0:  # the child: the interactive client
                os.chdir(project)
                os.execve(claude, [claude, "--settings", str(Path(tmp, "settings.json"))], env)
            try:
                _pump(fd, 8)
                os.write(fd, b"say hi")
                _pump(fd, 1)
                os.write(fd, b"\r")
                _pump(fd, 12)
            finally:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        inputs = sorted(saved.iterdir())
        if not inputs:
            raise SystemExit("the client never ran its status line command")
        text = inputs[-1].read_text()
        posts = [r for r in recorder.requests if r["method"] == "POST"]
        sent = {r["headers"].get("x-claude-code-session-id") for r in posts}
        session_id = json.loads(text)["session_id"]
        if sent != {session_id}:  # what `ikcode statusline` relies on
            raise SystemExit(f"session ids differ: headers {sent}, status line {session_id}")
        for local, fixed in ((str(project), "/home/user/project"), (tmp, "/tmp/session")):
            text = text.replace(local, fixed).replace(local.replace("/", "-"), fixed.replace("/", "-"))
    return json.loads(text)


def main() -> None:
    claude = sys.argv[1] if len(sys.argv) > 1 else os.environ["IKCODE_TEST_CLAUDE_BIN"]
    data = capture(str(Path(claude).resolve()) if os.sep in claude else claude)
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{OUT}: the status line input of claude {data.get('version')}")


if __name__ == "__main__":
    main()
