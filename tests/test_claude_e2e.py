"""The REAL Claude Code client, launched by `ikcode claude`, against a loopback recorder."""

import json
import os
import subprocess
import sys

import pytest

from ikcode import auth
from tests.recorder import Recorder

pytestmark = pytest.mark.claude


def test_real_claude_sends_only_the_served_model(claude_bin, claude_home):
    home, project = claude_home
    token = auth.load_or_create_token()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    env.update(
        {"HOME": str(home), "IKCODE_CLAUDE_BIN": claude_bin, "ANTHROPIC_API_KEY": "sk-ant-must-not-be-sent"}
    )
    with Recorder() as recorder:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "ikcode",
                "claude",
                "--base-url",
                recorder.url,
                "--",
                "-p",
                "say hi",
                "--output-format",
                "json",
            ],
            env=env,
            cwd=project,
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert proc.returncode == 0, f"stdout={proc.stdout[-2000:]}\nstderr={proc.stderr[-2000:]}"
    # The served model is declared to the client: no `[claude-code:unrecognized_model]` line,
    # nothing on stderr but ikcode's own notice about the profile's default arguments.
    foreign = [line for line in proc.stderr.splitlines() if not line.startswith("ikcode: ")]
    assert foreign == [], proc.stderr
    result = json.loads(proc.stdout)
    assert result["is_error"] is False
    assert "hi there" in result["result"]
    posts = [r for r in recorder.requests if r["method"] == "POST"]
    assert posts, "claude made no POST request"
    for request in posts:
        assert request["path"].split("?")[0] == "/v1/messages", request["path"]
        assert request["body"]["model"] == "smollm2-135m-instruct"
        assert request["headers"]["authorization"] == f"Bearer {token}"
        assert "x-api-key" not in request["headers"]
        assert not any(
            "x-anthropic-billing-header" in (b.get("text") or "")
            for b in request["body"].get("system") or []
            if isinstance(b, dict)
        )
