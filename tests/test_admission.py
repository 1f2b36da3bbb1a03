"""Admission policy: caps, ordering, shedding only cold work of new sessions, no starvation."""

from __future__ import annotations

import pytest

from ikcode.admission import AdmissionConfig, AdmissionPolicy, RequestClass
from ikcode.engines.base import CacheLookup, EngineOverloaded

COLD = CacheLookup(prompt_tokens=100_000, device_tokens=0)
WARM = CacheLookup(prompt_tokens=100_000, device_tokens=98_000)


def offer(policy: AdmissionPolicy, rid: str, lookup: CacheLookup, now: float, session: str | None = None):
    ticket = policy.make_ticket(rid, lookup, now, session)
    policy.offer(ticket, now)
    return ticket


def test_classify_counts_host_hits_as_cached():
    policy = AdmissionPolicy(AdmissionConfig(cold_threshold_tokens=10_000))
    assert (
        policy.classify(CacheLookup(100_000, device_tokens=50_000, host_tokens=45_000)) is RequestClass.WARM
    )
    assert policy.classify(CacheLookup(100_000, device_tokens=50_000)) is RequestClass.COLD


def test_cold_cap_respected_and_warm_goes_first():
    policy = AdmissionPolicy(AdmissionConfig(max_cold_prefills=2, shed=False))
    for i in range(5):
        offer(policy, f"c{i}", COLD, 0.0)
    offer(policy, "w0", WARM, 0.5)
    admitted = policy.admit(1.0)
    assert admitted[0].request_id == "w0"  # warm first although it came last
    assert [t.request_id for t in admitted[1:]] == ["c0", "c1"]
    assert policy.admit(1.1) == []  # cap reached
    policy.on_first_token("c0", 2.0)
    assert [t.request_id for t in policy.admit(2.0)] == ["c2"]
    assert policy.stats()["inflight_cold_prefills"] == 2


def test_aged_cold_ranks_with_warm_for_memory():
    policy = AdmissionPolicy(AdmissionConfig(aging_s=5.0, shed=False))
    offer(policy, "c0", COLD, 0.0)
    offer(policy, "w0", WARM, 9.0)
    # Memory for one request only: the aged cold one (arrived first) gets it.
    first = policy.admit(10.0, fits=lambda t, n=[0]: n.append(1) or len(n) <= 2)
    assert [t.request_id for t in first] == ["c0"]


def test_fifo_passes_through_in_arrival_order_without_caps():
    policy = AdmissionPolicy(AdmissionConfig(policy="fifo", prefill_tokens_per_s=1.0, ttft_bound_s=0.1))
    for i in range(4):
        offer(policy, f"c{i}", COLD, float(i))  # never shed, however slow
    offer(policy, "w", WARM, 5.0)
    assert [t.request_id for t in policy.admit(6.0)] == ["c0", "c1", "c2", "c3", "w"]


def test_sheds_only_cold_work_of_new_sessions():
    cfg = AdmissionConfig(prefill_tokens_per_s=10_000.0, ttft_bound_s=5.0)
    policy = AdmissionPolicy(cfg)
    with pytest.raises(EngineOverloaded) as err:
        offer(policy, "c0", COLD, 0.0, session="new")  # 100K tokens at 10K/s = 10 s > 5 s
    assert 1 <= err.value.retry_after_s <= 60
    # Its retry is queued, never shed twice.
    offer(policy, "c0-retry", COLD, 6.0, session="new")
    # Warm work is never shed, whatever the queue.
    for i in range(20):
        offer(policy, f"w{i}", WARM, 6.0, session=f"s{i}")
    # A running session's cold step (e.g. after an eviction) is queued, not shed.
    offer(policy, "w-run", WARM, 6.0, session="running")
    policy.admit(6.0)
    offer(policy, "cold-running", COLD, 7.0, session="running")
    stats = policy.stats()["queue_wait"]
    assert stats["cold"]["shed"] == 1 and stats["warm"]["shed"] == 0


def test_retry_after_is_capped_at_60_seconds():
    policy = AdmissionPolicy(AdmissionConfig(prefill_tokens_per_s=100.0, ttft_bound_s=1.0))
    with pytest.raises(EngineOverloaded) as err:
        offer(policy, "c", COLD, 0.0, session="x")
    assert err.value.retry_after_s == 60


def test_plan_prefill_gives_cold_its_share_under_warm_stream():
    policy = AdmissionPolicy(AdmissionConfig(cold_share=0.25))
    cold = offer(policy, "c", COLD, 0.0)
    policy.admit(0.0)
    cold_time = warm_steps = 0.0
    for step in range(400):
        warm = policy.make_ticket(f"w{step}", WARM, step * 0.01)
        grants = policy.plan_prefill(1000, [(cold, 10**9), (warm, 2000)], step * 0.01)
        policy.on_step(0.01, grants[0] > 0)
        cold_time += 0.01 if grants[0] else 0.0
        warm_steps += grants[1] > 0
    assert cold_time >= 0.2 * 4.0  # at least ~cold_share of the time
    assert warm_steps >= 0.6 * 400  # and warm tails run in most steps
