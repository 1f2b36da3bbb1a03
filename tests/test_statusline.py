"""`ikcode statusline` fed the JSON Claude Code 2.1.332 really writes to its statusLine command
(tests/data/claude-statusline.json, recorded by tests/data/capture_claude_statusline.py)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

from click.testing import CliRunner

from ikcode.cli import main
from ikcode.launcher.statusline import status_line

CLIENT_JSON = (Path(__file__).parent / "data" / "claude-statusline.json").read_text()
SESSION = json.loads(CLIENT_JSON)["session_id"]


def record(session: str = SESSION, **fields) -> dict:
    base = {
        "ts": "2026-11-30T13:00:00.000+00:00",
        "request_id": "msg_x",
        "session_id": session,
        "model": "smollm2-135m-instruct",
        "prompt_tokens": 1000,
        "cached_tokens_device": 0,
        "cached_tokens_host": 0,
        "queue_wait_ms": 3.2,
        "ttft_ms": 350.0,
        "error": None,
    }
    return {**base, **fields}


def write_log(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_recorded_client_json_has_what_the_line_needs():
    data = json.loads(CLIENT_JSON)
    assert data["version"].startswith("2.1.")
    assert data["model"]["id"] == "smollm2-135m-instruct"
    assert "prompt_cache" in data and "context_window" in data


def test_a_warm_turn_shows_hit_rate_tier_queue_and_ttft(tmp_path):
    log = write_log(
        tmp_path / "requests.jsonl",
        record(prompt_tokens=900, previous_prompt_tokens=None),
        record("another-session", prompt_tokens=5000),
        record(cached_tokens_device=960, cached_tokens_host=10, previous_prompt_tokens=950, ttft_ms=1520.0),
        record("another-session", prompt_tokens=7000, cached_tokens_host=10),
    )
    line = status_line(CLIENT_JSON, log)
    assert line == "smollm2-135m-instruct · cache 97% device · queue 3 ms · TTFT 1.5 s"


def test_miss_causes(tmp_path):
    cases = {
        "first request": record(),
        "prefix_break in system": record(
            previous_prompt_tokens=900, prefix_shared_tokens=10, prefix_break="system"
        ),
        "evicted": record(previous_prompt_tokens=900, prefix_shared_tokens=900, cached_tokens_host=100),
        "error: prompt is too long": record(error="prompt is too long: 9000 tokens > 8191 maximum"),
    }
    for cause, entry in cases.items():
        line = status_line(CLIENT_JSON, write_log(tmp_path / "requests.jsonl", entry))
        assert line.endswith(f"miss: {cause}" if not cause.startswith("error") else "8191 maximum"), line
        assert f"miss: {cause}" in line
    host = status_line(CLIENT_JSON, write_log(tmp_path / "r.jsonl", record(cached_tokens_host=990)))
    assert "cache 99% host" in host and "miss" not in host


def test_no_request_yet_bad_input_and_a_missing_log(tmp_path):
    assert "no request of this session" in status_line(CLIENT_JSON, tmp_path / "absent.jsonl")
    assert status_line("not json", tmp_path / "absent.jsonl").startswith("? · ")
    assert status_line("", tmp_path / "absent.jsonl").startswith("? · ")
    log = tmp_path / "requests.jsonl"
    log.write_text(
        '{"session_id": "' + SESSION + '", "prompt_tok\n' + json.dumps(record(cached_tokens_device=1000))
    )
    assert "cache 100% device" in status_line(CLIENT_JSON, log)


def test_settings_write_installs_a_status_line_that_runs(tmp_path, monkeypatch, project):
    monkeypatch.chdir(project)
    result = CliRunner().invoke(main, ["settings", "--write", "--statusline"])
    assert result.exit_code == 0, result.output
    data = json.loads((project / ".claude" / "settings.local.json").read_text())
    command = data["statusLine"]["command"]
    assert data["statusLine"]["type"] == "command"
    log = write_log(tmp_path / "requests.jsonl", record(cached_tokens_device=800))
    proc = subprocess.run(
        f"{command} --log {shlex.quote(str(log))}",
        shell=True,
        input=CLIENT_JSON,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "smollm2-135m-instruct · cache 80% device · queue 3 ms · TTFT 350 ms\n"


def test_the_installed_status_line_reads_the_log_of_its_own_home(tmp_path, monkeypatch, project):
    """Installed with IKCODE_HOME set (a server on its own home and port), run from a shell
    without it: it still reads that server's request log."""
    home = tmp_path / "ikcode-home"
    monkeypatch.setenv("IKCODE_HOME", str(home))
    monkeypatch.chdir(project)
    result = CliRunner().invoke(main, ["settings", "--write", "--statusline"])
    assert result.exit_code == 0, result.output
    command = json.loads((project / ".claude" / "settings.local.json").read_text())["statusLine"]["command"]
    from ikcode import daemon

    log = daemon.request_log_file()
    log.parent.mkdir(parents=True, exist_ok=True)
    write_log(log, record(cached_tokens_device=800))
    env = {k: v for k, v in os.environ.items() if k != "IKCODE_HOME"}
    proc = subprocess.run(command, shell=True, input=CLIENT_JSON, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "cache 80% device" in proc.stdout


def test_a_record_whose_model_is_not_a_string_still_gives_a_line(tmp_path):
    """An upstream front logs the client's `model` as it came: an object there crashed the line."""
    log = write_log(tmp_path / "requests.jsonl", record(model={"a": [["x"]]}), record(model="m" * 5000))
    line = status_line(CLIENT_JSON, log)
    assert "cache" in line and len(line) < 300
