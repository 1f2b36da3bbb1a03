"""doctor and bench, unchanged, against the upstream front (kind "anthropic") over a real ikcode
replica: the endpoint, contract and quality-gate checks pass on what the front relays (the cache
hit rate is the upstream's own report), and the live bench runs agents through it."""

from __future__ import annotations

import os

import pytest

from ikcode.bench.live import run_live
from ikcode.bench.workload import AgentsWorkload
from ikcode.doctor import PASS, DoctorContext, run_checks
from ikcode.profiles import load_profile
from tests.test_upstream_support import FRONT_TOKEN, EmbeddedReplica, front_records, front_server

pytestmark = pytest.mark.slow


@pytest.fixture
def front(tmp_path, monkeypatch):
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "claude-config"))
    replica = EmbeddedReplica(tmp_path)
    srv = front_server(tmp_path, "anthropic", [replica.url])
    yield srv.url
    srv.stop()
    replica.stop()


def test_doctor_passes_through_the_upstream_front(front, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    ctx = DoctorContext(
        profile=load_profile("local"),
        base_url=front,
        token=FRONT_TOKEN,
        project_dir=project,
        environ={"PATH": os.environ.get("PATH", "")},
        request_log=tmp_path / "front-requests.jsonl",
    )
    results = {r.name: r for r in run_checks(ctx, ["endpoint", "contract", "quality_gate"])}
    for name in ("endpoint", "contract", "quality_gate"):
        assert results[name].status == PASS, (name, results[name].detail)
    gate = results["quality_gate"].data["documents"][0]
    assert gate["match"] and gate["warm_hit_rate"] >= 0.95
    assert results["endpoint"].data["model"] == "tiny"
    warm = [r for r in front_records(tmp_path) if r.get("hit_rate") is not None and r["hit_rate"] >= 0.95]
    assert warm and all(r["cache_source"] == "reported_by_upstream" for r in warm)


def test_live_bench_runs_through_the_upstream_front(front):
    workload = AgentsWorkload(
        agents=2, context_tokens=300, tokens_per_step=40, output_tokens=4, tool_pause_s=0.05,
        steps_per_conversation=3, ramp_s=0.2, duration_s=4.0, seed=1,
    )  # fmt: skip
    report = run_live(front, FRONT_TOKEN, workload, model="tiny", timeout_s=60)
    print({k: report[k] for k in ("completed", "failed", "cached_token_share", "ttft", "shed_retries")})
    assert report["failed"] == 0 and report["completed"] >= 4
    # Turns after the first of each conversation extend it: the replica serves them from its cache,
    # and the bench reads that from the usage the front relays.
    assert report["cached_token_share"] > 0.4
