"""The REAL Claude Code client against `ikcode up` on the default model: two turns, cache hit.

The client is the pinned one (scripts/test.sh), launched by `ikcode claude` with the shipped
profile's own default arguments; stderr must hold nothing but ikcode's own notice.
"""

import json
import os
import re

import pytest

from ikcode import daemon
from tests.serving import free_port, ikcode, local_profile

pytestmark = [pytest.mark.claude, pytest.mark.model, pytest.mark.slow]


def _claude_env(claude_bin: str, home) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    env.update({"HOME": str(home), "IKCODE_CLAUDE_BIN": claude_bin})
    return env


def _foreign_stderr(stderr: str) -> list[str]:
    """stderr lines that are not ikcode's own notices (e.g. the client's unrecognized_model)."""
    return [line for line in stderr.splitlines() if not line.startswith("ikcode: ")]


def _log_lines() -> list[dict]:
    return [json.loads(line) for line in daemon.request_log_file().read_text().splitlines() if line.strip()]


def test_two_turns_through_ikcode_up(tmp_path, claude_bin, claude_home):
    home, project = claude_home
    profile = local_profile(tmp_path, free_port(), max_output_tokens=256)
    env = _claude_env(claude_bin, home)
    started = ikcode("up", "--profile", str(profile))
    assert started.returncode == 0, started.stderr
    try:
        first = ikcode(
            "claude",
            "--profile",
            str(profile),
            "--",
            "-p",
            "Name one planet.",
            "--output-format",
            "json",
            env=env,
            cwd=project,
            timeout=600,
        )
        assert first.returncode == 0, first.stderr[-3000:] + first.stdout[-3000:]
        assert _foreign_stderr(first.stderr) == [], first.stderr
        assert "adds claude arguments --tools=Bash,Read" in first.stderr  # the profile's own args
        result = json.loads(first.stdout)
        assert result["is_error"] is False
        after_first = _log_lines()
        assert after_first, "the server logged no request"

        second = ikcode(
            "claude",
            "--profile",
            str(profile),
            "--",
            "-p",
            "And another one?",
            "--continue",
            "--output-format",
            "json",
            env=env,
            cwd=project,
            timeout=600,
        )
        assert second.returncode == 0, second.stderr[-3000:] + second.stdout[-3000:]
        assert _foreign_stderr(second.stderr) == [], second.stderr
        second_result = json.loads(second.stdout)
        assert second_result["is_error"] is False
        lines = _log_lines()
        # The status line for this session, as Claude Code would run it (its JSON on stdin).
        status = ikcode("statusline", input=json.dumps({"session_id": second_result["session_id"]}))
    finally:
        ikcode("down")

    assert all(line["model"] == "smollm2-135m-instruct" for line in lines), [x["model"] for x in lines]
    assert all(line["error"] is None for line in lines), [x["error"] for x in lines]
    last_of_first = after_first[-1]
    first_of_second = lines[len(after_first)]
    assert first_of_second["session_id"] == last_of_first["session_id"]  # --continue: same conversation
    # The second turn re-reads the first turn's prompt from the cache (all but a partial block).
    covered = first_of_second["cached_tokens_device"] + first_of_second["cached_tokens_host"]
    assert covered >= 0.95 * last_of_first["prompt_tokens"], (covered, last_of_first["prompt_tokens"])
    turn_two = first_of_second["prompt_tokens"]
    print(f"turn 2: {covered}/{turn_two} prompt tokens from cache ({covered / turn_two:.1%})")
    assert covered >= 0.90 * turn_two
    assert first_of_second["session_id"] == second_result["session_id"]
    print("status line:", status.stdout.strip())
    assert status.returncode == 0, status.stderr
    shown = re.match(r"smollm2-135m-instruct · cache (\d+)% (device|host) · queue .* · TTFT ", status.stdout)
    assert shown and int(shown.group(1)) >= 90, status.stdout
