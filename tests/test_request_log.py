"""The request log as written (mode, rotation) and as doctor reads it back."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

from ikcode import daemon
from ikcode.doctor.request_log import read_records
from ikcode.gateway.request_log import RequestLog


def test_the_log_is_private_to_its_owner_wherever_it_is_put(tmp_path):
    """`request_log_path` can point anywhere: user names and session ids (and prompts, with
    log_prompts) were left readable by every account (the umask's 0644)."""
    path = tmp_path / "custom" / "requests.jsonl"
    log = RequestLog(path, max_bytes=200)
    for i in range(5):  # past max_bytes: rotated, and the new file is private too
        log.write({"request_id": f"r{i}", "prompt_tokens": 10, "pad": "x" * 100})
    log.close()
    for file in (path, path.with_name(path.name + ".1")):
        assert stat.S_IMODE(os.stat(file).st_mode) == 0o600, file


def test_doctor_reads_a_record_holding_a_unicode_line_separator_whole(tmp_path):
    """The log writes U+2028 and U+0085 unescaped inside strings; str.splitlines split the record
    there and doctor lost it."""
    path = tmp_path / "requests.jsonl"
    log = RequestLog(path)
    log.write({"request_id": "a", "session_id": "s\u2028x\x85y", "prompt_tokens": 10})
    log.write({"request_id": "b", "session_id": "plain", "prompt_tokens": 12})
    log.close()
    assert "\u2028" in path.read_text(encoding="utf-8")  # as the gateway writes it
    records = read_records(path)
    assert [r["request_id"] for r in records] == ["a", "b"]
    assert json.loads(json.dumps(records[0]))["session_id"] == "s\u2028x\x85y"


def test_logs_shows_the_last_lines_and_follows_a_rotation(tmp_path):
    """`ikcode logs --requests -f` kept reading requests.jsonl.1 after the 64 MB rotation (no new
    line ever appeared), and `-n` read the whole file into memory to print its end."""
    path = daemon.request_log_file()
    path.write_text("".join(f'{{"n": {i}}}\n' for i in range(1000)))
    shown = subprocess.run(
        [sys.executable, "-m", "ikcode", "logs", "--requests", "-n", "3"], capture_output=True, text=True
    )
    assert shown.stdout == '{"n": 997}\n{"n": 998}\n{"n": 999}\n'
    follower = subprocess.Popen(
        [sys.executable, "-m", "ikcode", "logs", "--requests", "-f", "-n", "0"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ),
    )  # fmt: skip
    try:
        time.sleep(2)  # it reads to the end and waits
        with path.open("a") as log:
            log.write('{"n": "before"}\n')
        time.sleep(1)
        path.replace(path.with_name(path.name + ".1"))  # what RequestLog._rotate does
        path.write_text('{"n": "after"}\n')
        time.sleep(2)
    finally:
        follower.terminate()
        out, _ = follower.communicate(10)
    assert out.splitlines() == ['{"n": "before"}', '{"n": "after"}']
