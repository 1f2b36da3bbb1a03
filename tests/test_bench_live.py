"""The live bench against real servers: it reads the cache from the final usage (long prompts
report it only there), bounds a whole turn even while the server pings, and counts a stream cut
before message_stop as failed."""

from __future__ import annotations

import time

import pytest

from ikcode.bench.live import run_live
from ikcode.bench.report import print_reports
from ikcode.bench.workload import AgentsWorkload
from tests.test_upstream_stream_faults import ScriptedReplica, _anthropic
from tests.test_upstream_support import UPSTREAM_TOKEN, EmbeddedReplica

pytestmark = pytest.mark.slow

START = _anthropic(
    "message_start",
    {"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant", "content": [],
     "model": "tiny", "stop_reason": None, "usage": {"input_tokens": 10, "output_tokens": 0}}},
)  # fmt: skip
PING = _anthropic("ping", {"type": "ping"})


def small_workload(**changes) -> AgentsWorkload:
    values = dict(
        agents=2, context_tokens=300, tokens_per_step=40, output_tokens=4, tool_pause_s=0.05,
        steps_per_conversation=3, ramp_s=0.2, duration_s=4.0, seed=1,
    )  # fmt: skip
    values.update(changes)
    return AgentsWorkload(**values)


def test_cache_figures_come_from_the_final_usage(tmp_path):
    """Past predict_usage_max_tokens (32K by default; 0 here, so every prompt) the gateway's
    message_start says nothing of the cache: the hits are in message_delta's usage."""
    replica = EmbeddedReplica(tmp_path, predict_usage_max_tokens=0)
    try:
        report = run_live(replica.url, UPSTREAM_TOKEN, small_workload(), model="tiny", timeout_s=60)
    finally:
        replica.stop()
    print({k: report[k] for k in ("completed", "failed", "cached_token_share", "ttft")})
    assert report["failed"] == 0 and report["completed"] >= 4
    assert report["cached_token_share"] > 0.3  # later steps extend the conversation the cache holds
    assert report["ttft"]["warm"]["n"] >= 2


def test_a_turn_that_only_pings_is_bounded_and_failed(capsys):
    """A wedged engine behind a live gateway: pings every 0.1 s reset httpx's read timeout, so
    only a whole-turn deadline ends it (and the run) on time."""
    replica = ScriptedReplica([START] + [PING] * 300, clean=True, pause_s=0.1)
    try:
        started = time.monotonic()
        report = run_live(replica.url, None, small_workload(agents=1, duration_s=1.0), timeout_s=1.5)
        took = time.monotonic() - started
    finally:
        replica.close()
    assert took < 10, took  # 30 s of pings otherwise
    assert report["failed"] == report["requests"] >= 1
    assert any("no whole answer within" in e for e in report["errors"])
    assert report["share_within_15s"] == 0.0  # a failed turn was not answered within 15 s
    print_reports([report])
    warm_row = [line for line in capsys.readouterr().out.splitlines() if "warm" in line]
    assert warm_row and "0.00" not in warm_row[0]  # no turn finished: a dash, not an instant 0.00


def test_a_stream_cut_before_message_stop_is_a_failed_turn():
    delta = _anthropic("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "text_delta", "text": "hi"}})  # fmt: skip
    replica = ScriptedReplica([START, delta], clean=True, pause_s=0.01)
    try:
        report = run_live(replica.url, None, small_workload(agents=1, duration_s=0.5), timeout_s=5)
    finally:
        replica.close()
    assert report["completed"] == 0 and report["failed"] >= 1
    assert any("before message_stop" in e for e in report["errors"])
