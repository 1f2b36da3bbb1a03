"""Admission policy: caps, ordering, shedding only cold work of new sessions, no starvation."""

from __future__ import annotations

import pytest

from ikcode.admission import AdmissionConfig, AdmissionPolicy, RequestClass
from ikcode.engines.base import CacheLookup, EngineOverloaded
from ikcode.engines.simulated import HardwareModel, SimRequest, SimulatedServer

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


def small_hardware() -> HardwareModel:
    return HardwareModel(
        name="tiny",
        prefill_s_per_token=1e-4,  # 10K tokens/s
        attention_s_per_token_ctx=0.0,
        prefill_chunk_tokens=1024,
        decode_base_s=0.01,
        decode_per_seq_s=0.0,
        decode_per_ctx_token_s=0.0,
        device_tier_tokens=4_000_000,
        host_tier_tokens=0,
    )


def test_no_starvation_of_a_cold_request_under_a_stream_of_warm_ones():
    """A 50K-token cold prefill (5 s alone) finishes within a bound while warm turns keep coming."""
    server = SimulatedServer(small_hardware(), AdmissionConfig(cold_share=0.25, shed=False), block_size=256)
    cold = SimRequest("cold", conversation=1, prompt_tokens=50_000, output_tokens=1, arrived_at=0.0)
    server.submit(cold)
    t, n = 0.0, 0
    while cold.first_token_at is None and t < 200.0:
        # A warm-classified turn (below the cold threshold) every 20 ms, 1,500 new tokens each:
        # they alone would keep the server busy all the time.
        if server.now >= t:
            n += 1
            server.submit(SimRequest(f"w{n}", 1000 + n, 1500, 1, arrived_at=server.now))
            t = server.now + 0.02
        server.step(t)
    assert cold.first_token_at is not None
    # Alone: 5 s. With the guaranteed 25% share of step time: at most ~4x, plus slack.
    assert cold.first_token_at <= 25.0, cold.first_token_at
