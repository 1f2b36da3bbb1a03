"""The simulated DeepInfer server: per-rank memory, lockstep steps, the engine's prefill vote,
the live router and cache; deterministic with a seed, and fast."""

from __future__ import annotations

import threading
from dataclasses import replace

from ikcode.admission import AdmissionConfig
from ikcode.bench.hardware import HardwareModel, adapter_schedule
from ikcode.bench.rank import SimRequest
from ikcode.bench.server import SimulatedServer
from ikcode.bench.simulate import run_simulation
from ikcode.bench.workload import AgentsWorkload
from ikcode.plan import plan
from ikcode.profiles import load_profile


def hardware() -> HardwareModel:
    return HardwareModel.from_dict(load_profile("deepinfer-4xb200").hardware)


def small_cards(kv_tokens_per_card: int = 3_000_000, cards: int = 2) -> HardwareModel:
    """Cards whose KV holds kv_tokens_per_card tokens (the rest of the profile's figures)."""
    hw = replace(hardware(), cards=cards)
    kv_bytes = kv_tokens_per_card * hw.kv_bytes_per_token
    weights = cards * (hw.card_memory_bytes * hw.memory_utilization - kv_bytes)
    return replace(hw, weights_bytes=weights)


def small(seed: int = 0, **kw) -> AgentsWorkload:
    base = dict(agents=10, context_tokens=60_000, duration_s=120.0, ramp_s=10.0, seed=seed)
    base.update(kw)
    return AgentsWorkload(**base)


def strip(report: dict) -> dict:
    report = dict(report)
    report.pop("simulator")
    return report


def test_same_seed_same_report_other_seed_differs():
    a = run_simulation(hardware(), AdmissionConfig(policy="ikcode"), small(1))
    b = run_simulation(hardware(), AdmissionConfig(policy="ikcode"), small(1))
    c = run_simulation(hardware(), AdmissionConfig(policy="ikcode"), small(2))
    assert strip(a) == strip(b)
    assert strip(a)["ttft"] != strip(c)["ttft"]


def test_per_card_figures_follow_from_physics():
    hw = hardware()
    assert hw.weights_per_card_bytes == 71e9  # 284 GB over 4 cards
    assert abs(hw.kv_bytes_per_card - 91e9) < 1e6  # 180 GB x 0.9 - 71 GB
    assert hw.kv_tokens_per_card * hw.cards // 1_000_000 == 56  # the published ~57M GPU tier
    assert abs(hw.cold_read_tokens_per_s() - 200_000) < 1  # the one calibrated figure
    assert hw.copy_seconds(450_000) < hw.prefill_seconds(450_000) / 100  # reload << recompute
    assert 0.015 < hw.decode_step_seconds(25 * 460_000) < 0.02  # weights + KV read per step


def test_ranks_step_in_lockstep_and_a_short_prompt_waits_for_the_long_one():
    """Two ranks: a 200K cold read on one, a 4K prompt on the other. The step lasts as long as its
    slowest rank, so both first tokens come at the end of the same prefill step."""
    server = SimulatedServer(small_cards(cards=2), AdmissionConfig(policy="fifo"), block_size=2048)
    long = SimRequest("long", 1, 200_000, 2, 0.0, session_id="a")
    short = SimRequest("short", 2, 4_000, 2, 0.0, session_id="b")
    server.submit(long)
    server.submit(short)
    while short.first_token_at is None:
        server.step(float("inf"))
    assert {long.rank, short.rank} == {0, 1}  # the router spread the two new sessions
    assert long.first_token_at == short.first_token_at
    assert short.first_token_at >= server.hw.prefill_seconds(200_000)


def test_prefill_waits_for_the_engines_vote():
    """One rank with work of four: prefill runs at the first ANY point (100 decode steps), not
    at once (scheduler.hpp:306-336)."""
    hw = small_cards(cards=4)
    server = SimulatedServer(hw, AdmissionConfig(policy="fifo"), block_size=2048)
    req = SimRequest("r", 1, 4_096, 2, 0.0, session_id="a")
    server.submit(req)
    while req.first_token_at is None:
        server.step(float("inf"))
    idle_step = hw.decode_step_seconds(0)
    assert server.decode_steps == hw.prefill_any_attempt_interval
    assert req.first_token_at >= hw.prefill_any_attempt_interval * idle_step


def test_a_session_stays_on_its_rank_and_memory_is_per_rank():
    server_report = run_simulation(small_cards(cards=2), AdmissionConfig(policy="fifo"), small())
    assert server_report["failed"] == 0
    assert server_report["cached_token_share"] > 0.8  # warm turns found their prefix on their rank
    assert [r["rank"] for r in server_report["ranks"]] == [0, 1]


def test_overflow_is_recomputed_without_a_host_tier_and_reloaded_with_one():
    """Twice the conversations a card holds: the baseline recomputes what fell out of its GPU tier
    (its cached share collapses); ikcode's host tier reloads it over PCIe."""
    hw = small_cards(kv_tokens_per_card=1_000_000, cards=2)
    load = small(agents=24, context_tokens=100_000, duration_s=240.0, ramp_s=20.0)
    fifo = run_simulation(hw, AdmissionConfig(policy="fifo"), load)
    ikcode = run_simulation(hw, AdmissionConfig(policy="ikcode", shed=False, max_cold_prefills=2), load)
    fits = run_simulation(hw, AdmissionConfig(policy="fifo"), replace(load, agents=6))
    assert fits["cached_token_share"] > 0.8
    assert fifo["cached_token_share"] < 0.5
    assert fifo["cache"]["cached_tokens_total{cache_source=host}"] == 0
    assert ikcode["cache"]["cached_tokens_total{cache_source=host}"] > 0
    assert ikcode["cached_token_share"] > fifo["cached_token_share"]
    assert fifo["failed"] == 0 and ikcode["failed"] == 0


def test_steady_section_counts_turns_after_every_first_turn():
    report = run_simulation(hardware(), AdmissionConfig(policy="fifo"), small())
    since = report["steady"]["from_s"]
    assert since is not None and since > 0
    assert report["steady"]["ttft"]["n"] + report["startup"]["ttft"]["n"] == report["completed"]


def test_admission_holds_200_x_500k_within_1_5x_of_the_median_at_plans_limit():
    """200 agents of 500K on 4x B200: plan says 138 fit. Admission holds the sessions active at once
    there (the others wait for a slot, shed once with 529 + retry-after, then queued), so the median
    turn, timed from each turn's first attempt, stays within 1.5x of the median at the limit, with
    no failed turn."""
    profile = load_profile("deepinfer-4xb200")
    hw, schedule = hardware(), adapter_schedule(profile)
    limit = plan(hw, 500_000, 200, engine_schedule=schedule)["max_agents_at_this_size"]
    ikcode = AdmissionConfig.from_dict(profile.admission, policy="ikcode")
    load = AgentsWorkload(agents=limit, context_tokens=500_000)
    at_limit = run_simulation(hw, ikcode, load, engine_schedule=schedule)
    over = run_simulation(hw, ikcode, replace(load, agents=200), engine_schedule=schedule)
    assert at_limit["admission"]["sessions_waited"] == 0
    assert over["admission"]["sessions_waited"] >= 200 - limit
    assert over["failed"] == 0 and over["shed_retries"] > 0
    assert over["ttft"]["p50"] <= 1.5 * at_limit["ttft"]["p50"], (at_limit["ttft"], over["ttft"])


def test_a_prompt_past_the_cards_watermark_fails_instead_of_hanging_the_run():
    """A prompt that fits the card but not under its prefill watermark was neither allocated nor
    failed: it held the rank's queue for ever and the run's clock went to infinity (a hang)."""
    workload = small(agents=1, context_tokens=640_000, duration_s=60)
    done: list[dict] = []
    runner = threading.Thread(
        target=lambda: done.append(
            run_simulation(
                small_cards(kv_tokens_per_card=700_000, cards=1), AdmissionConfig(policy="fifo"), workload
            )
        ),
        daemon=True,
    )
    runner.start()
    runner.join(120)
    assert done, "the simulation did not end"
    assert done[0]["failed"] >= 1 and "under the prefill watermark" in next(iter(done[0]["errors"]))


def test_a_first_turn_that_fails_at_its_rank_still_ends_the_start_up(monkeypatch):
    """A turn failed at the rank never got finished_at: one failed first turn emptied the steady
    section (every turn counted as start-up)."""
    from ikcode.bench import simulate

    first_turn = simulate.AgentScript.first_turn

    def oversized_for_agent_0(self):
        turn = first_turn(self)
        if self.agent == 0:
            turn.prompt_tokens = 2_000_000  # more than a card holds
        return turn

    monkeypatch.setattr(simulate.AgentScript, "first_turn", oversized_for_agent_0)
    cards = small_cards(kv_tokens_per_card=1_000_000, cards=2)
    report = run_simulation(cards, AdmissionConfig(policy="fifo"), small(agents=4, context_tokens=60_000))
    assert report["failed"] >= 1
    assert report["steady"]["from_s"] is not None and report["steady"]["ttft"]["n"] > 0


def test_the_simulated_gate_looks_a_waiting_warm_ticket_up_again_as_live_admission_does():
    """The live gate re-checks a warm ticket that waited (its prefix may have been evicted); the
    simulated server's requests carry no token ids, so the re-check never ran in the simulator."""
    server = SimulatedServer(small_cards(cards=2), AdmissionConfig(policy="ikcode"), block_size=2048)
    req = SimRequest("r", 1, 50_000, 2, 0.0, session_id="a")
    ticket = server.policy.make_ticket("r", server.lookup(req), 0.0, "a", req)
    assert server.controller._gate().uncached(ticket) == 50_000  # nothing cached yet
