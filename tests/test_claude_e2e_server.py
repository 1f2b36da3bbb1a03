"""The REAL Claude Code client against `ikcode up` on the default model: two turns, cache hit."""

import json
import os

import pytest

from ikcode import daemon
from tests.serving import free_port, ikcode, local_profile

pytestmark = [pytest.mark.claude, pytest.mark.model, pytest.mark.slow]


def _claude_env(claude_bin: str, home) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    env.update({"HOME": str(home), "IKCODE_CLAUDE_BIN": claude_bin})
    return env


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
        assert json.loads(second.stdout)["is_error"] is False
        lines = _log_lines()
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
