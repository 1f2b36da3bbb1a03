"""Admission policy: per-rank caps, ordering, shedding only cold work that cannot start, no starvation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ikcode.admission import AdmissionConfig, AdmissionPolicy, RequestClass
from ikcode.bench.hardware import HardwareModel
from ikcode.bench.rank import SimRequest
from ikcode.bench.server import SimulatedServer
from ikcode.engines.base import CacheLookup, EngineOverloaded
from ikcode.profiles import load_profile

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
    first = policy.admit(10.0, _OneRankGate(room=1))
    assert [t.request_id for t in first] == ["c0"]


def test_fifo_passes_through_in_arrival_order_without_caps():
    policy = AdmissionPolicy(AdmissionConfig(policy="fifo", prefill_tokens_per_s=1.0, ttft_bound_s=0.1))
    for i in range(4):
        offer(policy, f"c{i}", COLD, float(i))  # never shed, however slow
    offer(policy, "w", WARM, 5.0)
    assert [t.request_id for t in policy.admit(6.0)] == ["c0", "c1", "c2", "c3", "w"]


class _OneRankGate:
    """A one-rank engine's gate with room for `room` requests (the real one asks the engine)."""

    def __init__(self, room: int):
        self.room = room

    def place(self, ticket) -> int:
        return 0

    def fits(self, ticket) -> bool:
        self.room -= 1
        return self.room >= 0


def _busy(policy: AdmissionPolicy, now: float = 0.0) -> None:
    """Fill every cold slot with a running cold prefill of another session."""
    for i in range(policy.config.max_cold_prefills):
        offer(policy, f"busy{i}", COLD, now, session=f"busy{i}")
        policy.admit(now)


def test_sheds_only_cold_work_of_new_sessions():
    cfg = AdmissionConfig(prefill_tokens_per_s=10_000.0, ttft_bound_s=5.0)
    policy = AdmissionPolicy(cfg)
    _busy(policy)
    with pytest.raises(EngineOverloaded) as err:
        offer(policy, "c0", COLD, 0.0, session="new")  # 100K behind 2 x 100K at 10K/s = 30 s
    assert err.value.retry_after_s == 20  # back when the work ahead of it is done
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
    _busy(policy)
    with pytest.raises(EngineOverloaded) as err:
        offer(policy, "c", COLD, 0.0, session="x")
    assert err.value.retry_after_s == 60


def test_retired_step_planner_keys_are_accepted_and_mean_nothing():
    """cold_share and share_window_s tuned a step planner no engine ran (DeepInfer schedules its
    own chunks): removed, and a profile written before still loads."""
    config = AdmissionConfig.from_dict({"cold_share": 0.25, "share_window_s": 10.0, "max_cold_prefills": 3})
    assert config.max_cold_prefills == 3 and not hasattr(config, "cold_share")
    with pytest.raises(ValueError, match="unknown \\[admission\\] keys: cold_shar"):
        AdmissionConfig.from_dict({"cold_shar": 0.25})


def test_a_new_session_is_not_shed_while_a_cold_slot_is_free():
    # Its own read takes longer than the bound, but nothing is ahead of it: sending it away would
    # only leave the free slot idle until it comes back.
    policy = AdmissionPolicy(AdmissionConfig(prefill_tokens_per_s=10_000.0, ttft_bound_s=5.0))
    offer(policy, "c0", COLD, 0.0, session="new")
    assert [t.request_id for t in policy.admit(0.0)] == ["c0"]
    assert policy.stats()["queue_wait"]["cold"]["shed"] == 0


def test_a_cold_read_is_predicted_at_one_ranks_rate():
    # Four ranks share the server's 40K tokens/s: one 100K read takes 10 s on its rank, not 2.5 s.
    policy = AdmissionPolicy(AdmissionConfig(prefill_tokens_per_s=40_000.0, ttft_bound_s=5.0))
    policy.num_ranks = 4
    ticket = offer(policy, "c0", COLD, 0.0, session="new")
    assert ticket.predicted_ttft_s == pytest.approx(10.0)


def _sim_request(name: str, tokens: int) -> SimRequest:
    return SimRequest(name, hash(name) % 1000, tokens, 10, 0.0, session_id=name)


def test_cold_cap_is_per_rank_on_a_data_parallel_engine():
    # The simulated two-card DeepInfer server offers rank_loads()/placement() as a data-parallel
    # engine does: one cold read per rank runs at once, not one for the whole server.
    hw = replace(HardwareModel.from_dict(load_profile("deepinfer-4xb200").hardware), cards=2)
    server = SimulatedServer(hw, AdmissionConfig(max_cold_prefills=1, shed=False))
    a, b, c = (_sim_request(name, 200_000) for name in "abc")
    for req in (a, b, c):
        server.submit(req)
    server.step(0.0)  # admission, then the first prefill step
    assert {a.rank, b.rank} == {0, 1}  # one read on each card, in the same step
    assert a.first_token_at is not None and b.first_token_at is not None
    assert [t.request_id for t in server.policy.queue] == ["c"]  # both cards' slots are taken


def test_memory_gate_is_per_rank_a_full_card_does_not_hold_back_the_other():
    hw = replace(HardwareModel.from_dict(load_profile("deepinfer-4xb200").hardware), cards=2)
    server = SimulatedServer(hw, AdmissionConfig(max_cold_prefills=4, shed=False))
    big = int(hw.kv_tokens_per_card * 0.6)
    first = SimRequest("first", 1, big, 100_000, 0.0, session_id="s")
    server.submit(first)
    while first.first_token_at is None:
        server.step(float("inf"))
    # Same session, so the same card, where it cannot fit while `first` decodes; then a new one.
    held = SimRequest("held", 2, big, 10, server.now, session_id="s")
    other = SimRequest("other", 3, 100_000, 10, server.now, session_id="o")
    server.submit(held)
    server.submit(other)
    server.step(float("inf"))
    assert other.rank not in (-1, first.rank)  # admitted on the other card
    assert held.rank == -1 and [t.request_id for t in server.policy.queue] == ["held"]


class _EvictingGate:
    """One rank whose memory takes nothing until `room`; the engine's cache no longer holds
    anything (evicted)."""

    def __init__(self):
        self.room = False
        self.looked_up: list[str] = []

    def place(self, ticket):
        return 0

    def fits(self, ticket):
        return self.room

    def uncached(self, ticket):
        self.looked_up.append(ticket.request_id)
        return ticket.prompt_tokens


def test_a_warm_turn_evicted_while_queued_enters_as_cold_under_the_cap():
    """Classified at arrival only, a warm turn whose prefix was evicted while it waited (for
    memory) was admitted as warm: a full cold prefill outside the cold cap."""
    policy = AdmissionPolicy(AdmissionConfig(max_cold_prefills=1, shed=False))
    offer(policy, "c0", COLD, 0.0)
    assert [t.request_id for t in policy.admit(0.0)] == ["c0"]  # the one cold slot is taken
    offer(policy, "w0", WARM, 0.1)
    gate = _EvictingGate()
    assert policy.admit(0.5, gate) == [] and gate.looked_up == []  # held for memory; too soon to look
    gate.room = True
    assert policy.admit(2.0, gate) == []  # looked up again: cold now, and the cold slot is taken
    assert gate.looked_up == ["w0"] and policy.queue[0].cls is RequestClass.COLD
    assert policy.admit(2.5, gate) == [] and gate.looked_up == ["w0"]  # not looked up every round
