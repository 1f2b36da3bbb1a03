"""Doctor's checks that read the request log alone: silent_miss (a session's repeat that missed
the cache) and tail (warm and cold TTFT against the profile's bound)."""

from __future__ import annotations

import json

from ikcode.doctor import FAIL, DoctorContext
from ikcode.doctor.silent_miss import analyse
from ikcode.doctor.tail import check_tail
from ikcode.profiles import load_profile
from ikcode.upstream.metrics import finish_record


def log_record(session, prompt, cached, ttft_ms, shared=None, second=0):
    record = {
        "ts": f"2025-01-01T00:00:{second:02d}+00:00",
        "session_id": session,
        "prompt_tokens": prompt,
        "cached_tokens_device": cached,
        "cached_tokens_host": 0,
        "hit_rate": cached / prompt,
        "ttft_ms": ttft_ms,
        "duration_ms": 10,
    }
    if shared is not None:
        record["prefix_shared_tokens"] = shared
    return record


def test_silent_miss_blames_eviction_when_the_cache_hits_elsewhere():
    records = [
        log_record("a", 1000, 0, 500),
        log_record("a", 1200, 992, 50, shared=1000, second=1),
        log_record("b", 1000, 0, 500),
        log_record("b", 1200, 0, 500, shared=1000, second=1),
        # arrived while the previous turn still ran: its blocks were not committed yet, no miss
        log_record("c", 1000, 0, 500),
        log_record("c", 1200, 0, 500, shared=1000),
    ]
    result = analyse(records)
    assert result["miss_count"] == 1 and result["any_hit"] is True
    assert result["per_session"]["b"]["misses"] == 1 and result["per_session"]["a"]["misses"] == 0


def test_silent_miss_keeps_each_users_session_apart():
    """Two tokens sending one session id are two sessions, as the gateway keeps them: bob's first
    turn is no repeat of alice's (it was read under his own salt), so no miss."""
    alice1 = {**log_record("s", 10_000, 0, 500), "user": "alice"}
    bob1 = {**log_record("s", 10_000, 0, 500, second=1), "user": "bob"}
    alice2 = {**log_record("s", 10_200, 10_000, 50, shared=10_000, second=2), "user": "alice"}
    result = analyse([alice1, bob1, alice2])
    assert result["miss_count"] == 0 and result["pairs_checked"] == 1
    assert result["repeat_hit_rate"] == 1.0


def _tail_of(log, project):
    """The tail check on a log, against the 4xB200 profile's 15 s bound."""
    ctx = DoctorContext(
        profile=load_profile("deepinfer-4xb200"),
        base_url="http://127.0.0.1:1",
        token=None,
        project_dir=project,
        request_log=log,
    )
    return check_tail(ctx)


def test_tail_fails_when_warm_turns_queue(tmp_path, project):
    log = tmp_path / "requests.jsonl"
    records = [log_record(f"s{i}", 1000, 990, 20_000) for i in range(10)]  # warm turns starting after 20 s
    log.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    result = _tail_of(log, project)
    assert result.status == FAIL and "warm turns queue" in result.detail and "target 15 s" in result.detail
    assert result.data["warm"]["p95_s"] == 20.0


def test_silent_miss_reads_an_upstream_fronts_records():
    """The upstream front logs the upstream server's own count as `cached_tokens` (no tier):
    silent_miss read 0 from it and failed every healthy vLLM, SGLang or llama.cpp deployment."""
    records = []
    for turn, (prompt, cached) in enumerate([(1000, 0), (1200, 992), (1400, 1184)]):
        record = {"ts": f"2026-01-01T00:00:{turn * 10:02d}.000+00:00", "session_id": "s", "duration_ms": 10}
        finish_record(record, prompt, cached, 50)
        records.append(record)
    result = analyse(records)
    assert result["any_hit"] is True and result["miss_count"] == 0, result
    assert result["per_session"]["s"]["hit_rate"] > 0.5


def test_tail_counts_the_turns_whose_client_gave_up_waiting(tmp_path, project):
    """Turns whose client left before a first token are the slowest of all: dropped, the p95 and
    the verdict read only the fast ones (10 at 0.5 s passed beside 10 that waited a minute)."""
    answered = [log_record(f"s{i}", 1000, 990, 500) for i in range(10)]
    gave_up = [
        {**log_record(f"t{i}", 1000, 990, None), "duration_ms": 60_000, "error": "client disconnected"}
        for i in range(10)
    ]
    log = tmp_path / "requests.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in answered + gave_up) + "\n")
    result = _tail_of(log, project)
    assert result.status == FAIL, result.detail
    assert result.data["warm"]["p95_s"] >= 60.0 and result.data["warm"]["gave_up"] == 10
    assert "10 left before a first token" in result.detail
