"""Sessions active at once, held at the limit `ikcode plan` computes: the policy on its own, the
serving stack's wiring, and the live gate over HTTP (real gateway, real embedded engine)."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import httpx
import pytest

from ikcode import stack
from ikcode.admission import AdmissionConfig, AdmissionController, AdmissionPolicy
from ikcode.bench.hardware import HardwareModel, adapter_schedule
from ikcode.engines.base import CacheLookup, EngineOverloaded
from ikcode.gateway import BackgroundServer, create_app
from ikcode.plan import plan, session_limit
from ikcode.profiles import load_profile
from ikcode.stack import _session_limit
from tests.test_gateway_api_support import TOKENS, assert_error, settings
from tests.test_gateway_support import tiny_tokenizer
from tests.tiny_model import tiny_engine

COLD = CacheLookup(prompt_tokens=100_000, device_tokens=0)
WARM = CacheLookup(prompt_tokens=100_000, device_tokens=98_000)


def two_sessions(**overrides) -> AdmissionPolicy:
    config = dict(max_active_sessions=2, session_idle_s=10.0, max_cold_prefills=8)
    config.update(overrides)
    return AdmissionPolicy(AdmissionConfig(**config))


def offer(policy: AdmissionPolicy, rid: str, lookup: CacheLookup, now: float, session: str | None):
    policy.offer(policy.make_ticket(rid, lookup, now, session), now)


def ids(tickets) -> list[str]:
    return [t.request_id for t in tickets]


# ---- the policy --------------------------------------------------------------------------------
def test_a_new_session_past_the_limit_is_shed_once_then_waits_for_a_slot_in_order():
    policy = two_sessions()
    offer(policy, "a0", COLD, 0.0, "a")
    offer(policy, "b0", COLD, 0.0, "b")
    assert ids(policy.admit(0.0)) == ["a0", "b0"]
    with pytest.raises(EngineOverloaded) as shed:
        offer(policy, "c0", COLD, 1.0, "c")
    # Both sessions have work in flight: no slot frees before retry-after's ceiling.
    assert shed.value.retry_after_s == 60
    with pytest.raises(EngineOverloaded):
        offer(policy, "d0", COLD, 1.5, "d")
    # Sessions holding a slot go on: their turns are never held for one.
    policy.on_done("a0", 2.0)
    policy.on_done("b0", 2.0)
    offer(policy, "a1", WARM, 3.0, "a")
    assert ids(policy.admit(3.0)) == ["a1"]
    policy.on_done("a1", 4.0)
    # The retries are queued, not shed again, and wait until a session is idle for idle_s:
    # b's last turn ended at 2.0, so its slot frees at 12.0; the first to come back takes it.
    offer(policy, "d1", COLD, 5.0, "d")
    offer(policy, "c1", COLD, 6.0, "c")
    assert policy.admit(11.9) == []
    assert ids(policy.admit(12.0)) == ["d1"]
    assert ids(policy.admit(14.0)) == ["c1"]  # a's slot (idle since 4.0)
    stats = policy.stats()
    assert stats["active_sessions"] == 2 and stats["max_active_sessions"] == 2
    assert stats["sessions_waited"] == 2


def test_a_queued_turn_keeps_its_session_busy_and_a_returning_session_skips_the_wait():
    policy = two_sessions(shed=False)
    for s in ("a", "b"):
        offer(policy, f"{s}0", COLD, 0.0, s)
    policy.admit(0.0)
    policy.on_done("a0", 1.0)
    policy.on_done("b0", 1.0)
    offer(policy, "c0", COLD, 2.0, "c")  # no shedding: new sessions wait in the queue
    offer(policy, "d0", COLD, 2.0, "d")
    # a's next turn waits for memory on its rank: a is at work, not idle, however long it waits,
    # so only b's slot frees (to c, first in line).
    offer(policy, "a1", WARM, 5.0, "a")
    assert ids(policy.admit(20.0, _RankFull(session="a"))) == ["c0"]
    assert ids(policy.admit(21.0)) == ["a1"]
    assert policy.slots.num_active() == 2
    # b comes back after its slot was given away: it gets one at once, over the limit, because
    # its turns were counted in it all along; new sessions wait until the count is under it.
    offer(policy, "b1", WARM, 22.0, "b")
    assert ids(policy.admit(22.0)) == ["b1"]
    assert policy.slots.num_active() == 3


def test_the_limit_follows_the_conversations_size_through_plans_function():
    hw = HardwareModel.from_dict(load_profile("deepinfer-4xb200").hardware)
    schedule = adapter_schedule(load_profile("deepinfer-4xb200"))
    limit = session_limit(hw, schedule)
    for context in (450_000, 500_000):
        assert limit(context) == plan(hw, context, 1, engine_schedule=schedule)["max_agents_at_this_size"]
    assert limit(500_000) == 138 and limit(450_000) == 150
    policy = AdmissionPolicy(AdmissionConfig(), limit)
    offer(policy, "s0", CacheLookup(500_000), 0.0, "s")
    policy.admit(0.0)
    assert policy.stats()["max_active_sessions"] == 138


def test_no_limit_for_fifo_for_zero_or_without_hardware_and_sessionless_requests_hold_while_in_flight():
    always_one = lambda _tokens: 1  # noqa: E731
    for config, limit in (
        (AdmissionConfig(policy="fifo"), always_one),
        (AdmissionConfig(max_active_sessions=0, max_cold_prefills=8), always_one),
        (AdmissionConfig(max_cold_prefills=8), None),
    ):
        policy = AdmissionPolicy(config, limit)
        for i in range(5):
            offer(policy, f"r{i}", COLD, 0.0, f"s{i}")
        assert len(policy.admit(0.0)) == 5
    policy = AdmissionPolicy(AdmissionConfig(max_cold_prefills=8, shed=False), always_one)
    offer(policy, "x", COLD, 0.0, None)
    offer(policy, "y", COLD, 0.0, None)
    assert ids(policy.admit(0.0)) == ["x"]
    policy.on_done("x", 1.0)  # nothing can come back under a request's own id: free at once
    assert ids(policy.admit(1.0)) == ["y"]


def test_config_checks_the_limit():
    for bad in (-1, "half", True, 1.5):
        with pytest.raises(ValueError, match="max_active_sessions"):
            AdmissionConfig(max_active_sessions=bad)
    with pytest.raises(ValueError, match="session_idle_s"):
        AdmissionConfig(session_idle_s=-1.0)
    assert AdmissionConfig.from_dict({"max_active_sessions": 40}).max_active_sessions == 40


def test_the_serving_stack_takes_plans_limit_from_the_profiles_hardware(monkeypatch):
    limit = _session_limit(load_profile("deepinfer-4xb200"))
    assert limit is not None and limit(500_000) == 138
    assert _session_limit(load_profile("local")) is None  # no [hardware] figures: no limit
    # `ikcode up` on a profile with figures: the admission it builds holds plan's limit.
    names = ("name", "cards", "weights_bytes", "prefill_flops_per_s")
    figures = {name: getattr(small_server(), name) for name in names}
    profile = load_profile("local").model_copy(update={"hardware": figures})
    engine = tiny_engine(kv_memory_bytes=1 << 20)
    monkeypatch.setattr(stack, "_embedded_engine", lambda *_: (engine, tiny_tokenizer(), "tiny"))
    built = stack.build_stack(profile)
    try:
        assert isinstance(built.engine, AdmissionController)
        assert built.engine.policy.slots.max_active(1_000) == 2
    finally:
        built.engine.shutdown(5)


class _RankFull:
    """Two ranks: the session's requests go to rank 0, which has no memory; the rest to rank 1."""

    def __init__(self, session: str):
        self.session = session

    def place(self, ticket) -> int:
        ticket.rank = 0 if ticket.session_id == self.session else 1
        return ticket.rank

    def fits(self, ticket) -> bool:
        return ticket.rank == 1


# ---- live, over HTTP ---------------------------------------------------------------------------
def small_server() -> HardwareModel:
    """One card whose compute carries two agents of any small conversation (plan's limit)."""
    card = dict(cards=1, weights_bytes=71e9, prefill_flops_per_s=1e13)
    return replace(HardwareModel(), name="one-slow-card", **card)


@pytest.mark.slow
def test_the_live_gate_holds_sessions_at_plans_limit_over_http(tmp_path):
    hw = small_server()
    assert plan(hw, 1_000, 3)["max_agents_at_this_size"] == 2 and not plan(hw, 1_000, 3)["fits"]
    engine = tiny_engine(kv_memory_bytes=4 * 1024 * 1024)
    config = AdmissionConfig(policy="ikcode", session_idle_s=1.0)
    controller = AdmissionController(engine, config, session_limit=session_limit(hw))
    controller.start()
    srv = BackgroundServer(create_app(controller, tiny_tokenizer(), settings(tmp_path))).start()

    def turn(session: str, text: str) -> httpx.Response:
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
        headers = {"x-api-key": TOKENS["alice"], "x-claude-code-session-id": session}
        return httpx.post(srv.url + "/v1/messages", json=body, headers=headers, timeout=60)

    try:
        assert turn("sess-a", "first agent, first step").status_code == 200
        assert turn("sess-b", "second agent, first step").status_code == 200
        # The third session would take the server past what plan says it carries.
        shed = turn("sess-c", "third agent, first step")
        assert_error(shed, 529, "overloaded_error")
        assert "sessions are active" in shed.json()["error"]["message"]
        assert 1 <= int(shed.headers["retry-after"]) <= 60
        # A session holding a slot goes on at once.
        assert turn("sess-a", "first agent, second step").status_code == 200
        metrics = httpx.get(srv.url + "/metrics", headers={"x-api-key": TOKENS["alice"]}).text
        assert "ikcode_admission_active_sessions 2.0" in metrics
        assert "ikcode_admission_max_active_sessions 2.0" in metrics
        # The retry is queued (shed once) and served once a session has been idle for idle_s.
        sent = time.monotonic()
        assert turn("sess-c", "third agent, first step").status_code == 200
        assert time.monotonic() - sent < 30
        # Its wait for a slot is in the request log's queue wait (the engine's queue alone says ~0).
        waits = controller.stats()["queue_wait"]
        waited_s = max(by_class["max_wait_s"] for by_class in waits.values())
        logged = json.loads((tmp_path / "requests.jsonl").read_text().splitlines()[-1])
        assert waited_s > 0.1 and logged["queue_wait_ms"] >= waited_s * 1000
    finally:
        srv.stop()
        controller.shutdown(5)


def test_what_admission_remembers_per_session_is_bounded():
    """Session ids come from a client header: one new id per request grew admission's memory of
    sessions for ever (nothing older than session_memory_s is read again)."""
    from ikcode.admission.sessions import MAX_SESSIONS

    policy = AdmissionPolicy(AdmissionConfig(max_active_sessions=0, session_memory_s=60.0))
    now = 0.0
    for i in range(MAX_SESSIONS + 2_000):
        now += 0.001 if i < MAX_SESSIONS + 1_000 else 1.0  # the last thousand span 1,000 s
        ticket = policy.make_ticket(f"r{i}", CacheLookup(prompt_tokens=100, device_tokens=0), now, f"s{i}")
        policy.offer(ticket, now)
        for admitted in policy.admit(now):
            policy.on_first_token(admitted.request_id, now)
            policy.on_done(admitted.request_id, now)
    assert len(policy._sessions) <= 61  # noqa: SLF001 - those seen within session_memory_s
    assert f"s{MAX_SESSIONS + 1_999}" in policy._sessions  # noqa: SLF001
