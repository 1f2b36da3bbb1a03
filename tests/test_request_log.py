"""The request log as written (mode, rotation) and as doctor reads it back."""

from __future__ import annotations

import json
import os
import stat

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
