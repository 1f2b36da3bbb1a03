"""DeepInferEngine's placement methods (ikcode.engines.placement) in front of the real engine core
(tests/deepinfer_build/): admission sees one rank per process, the cold cap holds per rank, and
asking where a request would go leaves the router as it was."""

from __future__ import annotations

import threading
import time

import pytest

from ikcode.admission import AdmissionConfig, AdmissionController
from ikcode.engines.base import EngineRequest, SamplingParams
from ikcode.engines.deepinfer.routing import SessionRouter
from tests.deepinfer_build.harness import finished_normally, random_tokens, real_engine, run, wait_quiet


def request(rid: str, prompt: list[int], session: str, max_tokens: int = 24) -> EngineRequest:
    return EngineRequest(
        rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), session_id=session
    )


def first_turn_home(engine, prompt: list[int]) -> int:
    """Run session "s"'s first turn to its end; the rank the router gave the session."""
    _, final = run(engine, "first", prompt, max_tokens=8, session="s")
    assert finished_normally(final)
    return engine.router._sessions["s"]  # noqa: SLF001


def test_peek_answers_like_route_and_remembers_nothing():
    router = SessionRouter(2, max_imbalance=1)
    assert router.route("a", lambda r: 0, lambda r: 0) == 0
    state = (dict(router._sessions), list(router._per_rank))  # noqa: SLF001
    # a new session goes where route() would put it (rank 1: fewer sessions) ...
    assert router.peek("b", lambda r: 0, lambda r: 0) == 1
    # ... and a known one leaves its rank when that rank is too busy, without moving there
    assert router.peek("a", lambda r: 0, lambda r: [3, 0][r]) == 1
    assert (dict(router._sessions), list(router._per_rank)) == state  # noqa: SLF001
    assert router.route("a", lambda r: 0, lambda r: 0) == 0


def test_a_session_leaves_a_busy_rank_only_for_one_that_gets_through_sooner():
    router = SessionRouter(2, max_imbalance=1)
    assert router.route("a", lambda r: 0, lambda r: 0) == 0
    cached = [100, 0]  # the conversation's blocks, on its rank only
    queued = [3, 0]  # its rank has 3 requests more waiting for their prefill
    # small ones (20 blocks in all): its rank gets through 20 + 5 before the other reads 105
    assert router.route("a", lambda r: cached[r], lambda r: queued[r], lambda r: [25, 105][r]) == 0
    assert router.peek("a", lambda r: cached[r], lambda r: queued[r], lambda r: [105, 105][r]) == 0
    # a cold read of 300 blocks queued there: the other rank is through sooner
    assert router.route("a", lambda r: cached[r], lambda r: queued[r], lambda r: [305, 105][r]) == 1
    assert router.route("a", lambda r: 0, lambda r: 0) == 1  # and the session is remembered there


@pytest.mark.deepinfer
def test_admission_over_two_ranks_caps_cold_prefills_per_rank(tmp_path):
    engine = real_engine(tmp_path, ranks=2)
    config = AdmissionConfig(policy="ikcode", cold_threshold_tokens=64, max_cold_prefills=1, shed=False)
    controller = AdmissionController(engine, config)
    try:
        controller.start()
        loads = engine.rank_loads()
        assert controller.policy.num_ranks == 2 and len(loads) == 2
        info = engine.ranks[0].info
        assert loads[0].kv_blocks_total == info["total_blocks"] - info["reserve_blocks"] > 0

        seen: list[tuple[int, ...]] = []  # cold tickets in flight per rank, sampled
        routed: dict[str, tuple[int, int]] = {}  # request id -> (admission's rank, the engine's)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                with controller._cv:  # noqa: SLF001 - the policy's own view, read under its lock
                    inflight = list(controller.policy.inflight.values())
                with engine._lock:  # noqa: SLF001
                    where = {rid: rank.rank for rid, (_, rank) in engine._streams.items()}  # noqa: SLF001
                per_rank = [0, 0]
                for t in inflight:
                    per_rank[t.rank] += t.cls.value == "cold"
                    if t.request_id in where:
                        routed[t.request_id] = (t.rank, where[t.request_id])
                seen.append(tuple(per_rank))
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        streams = [
            controller.submit(request(f"cold-{i}", random_tokens(700, 100 + i), f"s{i}")) for i in range(4)
        ]
        finals = [s.collect(240)[1] for s in streams]
        done.set()
        sampler.join()
        assert all(finished_normally(f) for f in finals), finals
        assert max(max(s) for s in seen) == 1, "two cold prefills ran on one rank"
        assert max(sum(s) for s in seen) == 2, "the cold cap was pooled over the ranks"
        assert routed and all(a == b for a, b in routed.values()), routed  # placement == submit's route
        wait_quiet(engine)
    finally:
        controller.shutdown(5)
        engine.shutdown(drain_timeout_s=5)


@pytest.mark.deepinfer
def test_placement_leaves_the_router_as_it_was(tmp_path):
    engine = real_engine(tmp_path, ranks=2, affinity_max_imbalance=0)
    try:
        prompt = random_tokens(1500, 7)
        home = first_turn_home(engine, prompt)
        state = (dict(engine.router._sessions), list(engine.router._per_rank))  # noqa: SLF001
        wait_quiet(engine)
        # With requests being admitted on its rank (past affinity_max_imbalance) the session
        # stays: no other rank would get through its prefill sooner, its prompt is cached at home
        # only, and no prefill is queued there ...
        busy = [0, 0]
        busy[home] = 3
        stay_busy = engine.placement(request("second", prompt, "s"), busy)
        assert stay_busy.rank == home
        assert stay_busy.kv_blocks == -(-len(prompt) // 128)
        # ... as without them, where its device hit takes nothing beyond the prompt's blocks: the
        # hit is copied into them and the cached blocks it came from go back free
        stay = engine.placement(request("second", prompt, "s"), [0, 0])
        assert stay.rank == home
        assert stay.kv_blocks == stay_busy.kv_blocks
        placed = engine.placement(request("other", random_tokens(600, 9), "new"), [0, 0])
        assert (dict(engine.router._sessions), list(engine.router._per_rank)) == state  # noqa: SLF001
        # a new session placed on the idle rank, then submitted, is routed there too
        stream = engine.submit(request("other", random_tokens(600, 9), "new", max_tokens=8))
        assert engine.router._sessions["new"] == placed.rank != home  # noqa: SLF001
        assert finished_normally(stream.collect(120)[1])
        tokens2, final2 = run(engine, "second", prompt, max_tokens=8, session="s")
        assert finished_normally(final2) and final2.stats.cached_tokens_device > 0
        assert engine.router._sessions["s"] == home  # noqa: SLF001
    finally:
        engine.shutdown(drain_timeout_s=5)


@pytest.mark.deepinfer
def test_a_session_stays_on_its_rank_while_that_rank_only_decodes_more(tmp_path):
    """The router's load is a rank's queue for prefill: a request decoding there does not delay
    the session's next turn, and leaving would read the whole conversation again elsewhere."""
    engine = real_engine(tmp_path, ranks=2, affinity_max_imbalance=0)
    try:
        prompt = random_tokens(1500, 11)
        home = first_turn_home(engine, prompt)
        wait_quiet(engine)
        # A long answer of the same session decodes on its rank: it runs one request more than
        # the other rank, none waiting for prefill.
        busy = engine.submit(request("busy", random_tokens(300, 12), "s", max_tokens=6000))
        first = next(iter(busy))
        assert first.token_ids and not first.finished
        with engine._lock:  # noqa: SLF001
            assert engine._streams["busy"][1].rank == home  # noqa: SLF001
        assert [engine._queued(r) for r in (0, 1)] == [0, 0]  # noqa: SLF001
        assert len(engine.ranks[home].requests) == 1
        _, final2 = run(engine, "second", prompt, max_tokens=8, session="s")
        assert finished_normally(final2) and final2.stats.cached_tokens_device > 0
        assert engine.router._sessions["s"] == home  # noqa: SLF001
        busy.abort()
        _, last = busy.collect(60)
        assert not finished_normally(last), "the long answer ended before the second turn was routed"
        wait_quiet(engine)
    finally:
        engine.shutdown(drain_timeout_s=5)
