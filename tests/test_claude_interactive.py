"""The interactive start of the REAL Claude Code client through `ikcode claude`, in a terminal
(tmux): the screen shows no warning from the client. The screen is kept in the test's folder."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from tests.recorder import Recorder

pytestmark = pytest.mark.claude

# What the client prints about variables it rejects (e.g. `CLAUDE_CODE_AUTO_COMPACT_WINDOW="8192"
# reads as 8,192 tokens, so Claude Code treats it as the 100k minimum...`), and other warnings.
WARNING = re.compile(r"CLAUDE_CODE_|ANTHROPIC_|warning|\[autocompact\]|treats it as|unset it", re.IGNORECASE)
READY = re.compile(r"❯|\? for shortcuts")


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=30).stdout


def test_interactive_start_shows_no_client_warning(claude_bin, claude_home, tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/test.sh installs it)")
    home, project = claude_home
    session = f"ikcode-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    env.update({"HOME": str(home), "IKCODE_CLAUDE_BIN": claude_bin, "TERM": "xterm-256color"})
    with Recorder() as recorder:
        command = shlex.join([sys.executable, "-m", "ikcode", "claude", "--base-url", recorder.url])
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if k.isidentifier())
        script = tmp_path / "start.sh"
        script.write_text(f"cd {shlex.quote(str(project))} && env -i {exports} {command}\n")
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "50", f"bash {script}"],
            check=True,
            timeout=30,
        )
        try:
            screen = ""
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                time.sleep(2)
                screen = _tmux("capture-pane", "-p", "-t", session)
                if "Claude Code" in screen and READY.search(screen):
                    time.sleep(3)  # warnings are printed just after the first frame
                    screen = _tmux("capture-pane", "-p", "-t", session)
                    break
        finally:
            _tmux("kill-session", "-t", session)
    (tmp_path / "screen.txt").write_text(screen)
    assert "Claude Code" in screen, f"the client did not start:\n{screen}"
    warnings = [line for line in screen.splitlines() if WARNING.search(line)]
    assert not warnings, "the client warned at start:\n" + "\n".join(warnings) + f"\n\nscreen:\n{screen}"
