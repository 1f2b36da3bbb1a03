"""The AdmissionController in front of the real embedded engine (tiny model): order, caps, shedding."""

import random
import threading
import time

import pytest

from ikcode.admission import AdmissionConfig, AdmissionController
from ikcode.engines.base import EngineOverloaded, EngineRequest, SamplingParams
from tests.tiny_model import assert_pool_clean, tiny_engine


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _request(rid: str, prompt: list[int], session: str | None, max_tokens: int = 4) -> EngineRequest:
    return EngineRequest(
        rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), session_id=session
    )


def _first_token_times(streams: dict) -> dict[str, float]:
    times: dict[str, float] = {}

    def read(rid, stream):
        for event in stream:
            if event.token_ids and rid not in times:
                times[rid] = time.monotonic()
            assert event.error is None, event.error

    threads = [threading.Thread(target=read, args=item) for item in streams.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return times


@pytest.fixture
def engine():
    engine = tiny_engine(kv_memory_bytes=4 << 20, max_prefill_tokens_per_step=16)
    yield engine
    engine.shutdown(5)


def test_warm_turn_jumps_the_cold_queue_and_cold_cap_holds(engine):
    controller = AdmissionController(
        engine, AdmissionConfig(policy="ikcode", cold_threshold_tokens=64, max_cold_prefills=1, shed=False)
    )
    controller.start()
    base = _prompt(0, 600)
    _, final = controller.submit(_request("prime", base, "s-warm")).collect(60)
    assert final.error is None
    assert_pool_clean(engine)

    streams = {
        "cold-a": controller.submit(_request("cold-a", _prompt(1, 1200), "s-a")),
        "cold-b": controller.submit(_request("cold-b", _prompt(2, 1200), "s-b")),
        "warm": controller.submit(_request("warm", base + _prompt(3, 20), "s-warm")),
    }
    times = _first_token_times(streams)
    assert set(times) == {"cold-a", "cold-b", "warm"}
    assert times["warm"] < times["cold-b"], "the warm turn waited behind a queued cold prefill"
    assert times["cold-a"] < times["cold-b"], "the cold cap let both cold prefills run together"
    assert_pool_clean(engine)
    controller.shutdown(5)


def test_fifo_keeps_arrival_order(engine):
    controller = AdmissionController(engine, AdmissionConfig(policy="fifo"))
    controller.start()
    base = _prompt(0, 600)
    controller.submit(_request("prime", base, "s-warm")).collect(60)
    streams = {
        "cold-a": controller.submit(_request("cold-a", _prompt(1, 1200), "s-a")),
        "warm": controller.submit(_request("warm", base + _prompt(3, 20), "s-warm")),
    }
    times = _first_token_times(streams)
    assert set(times) == {"cold-a", "warm"}
    assert_pool_clean(engine)
    controller.shutdown(5)


def _shedding_controller(engine) -> AdmissionController:
    """One cold prefill at a time, 1,000 tokens/s assumed, a bound any wait exceeds: a new
    session's cold turn that cannot start now is shed."""
    config = AdmissionConfig(
        policy="ikcode", cold_threshold_tokens=64, max_cold_prefills=1, ttft_bound_s=0.001,
        prefill_tokens_per_s=1000.0,
    )  # fmt: skip
    controller = AdmissionController(engine, config)
    controller.start()
    return controller


def test_only_new_cold_work_that_cannot_start_is_shed(engine):
    controller = _shedding_controller(engine)
    # The cold slot is free: a new session's cold turn starts now, whatever its own read takes.
    running = controller.submit(_request("first-cold", _prompt(4, 1500), "s-first", max_tokens=64))
    # The slot is taken (1500 tokens at 1000/s ahead of it): the next new session is sent away
    # until that work is done, not longer.
    with pytest.raises(EngineOverloaded) as shed:
        controller.submit(_request("new-cold", _prompt(5, 1500), "s-new"))
    assert 1 <= shed.value.retry_after_s <= 2
    assert running.collect(60)[1].error is None
    # Its retry is queued, not shed again (a session is shed at most once), and completes.
    _, final = controller.submit(_request("new-cold-retry", _prompt(5, 1500), "s-new")).collect(60)
    assert final.error is None
    # A warm step of that running session is never shed.
    _, final = controller.submit(_request("warm", _prompt(5, 1500) + [7, 8, 9], "s-new")).collect(60)
    assert final.error is None
    assert final.stats.cached_tokens >= 1400
    assert controller.stats()["queue_wait"]["cold"]["shed"] == 1
    assert_pool_clean(engine)
    controller.shutdown(5)


def test_a_request_without_a_session_id_is_shed_once_too(engine):
    """Without a session id nothing said its retry was one: under sustained cold load it was shed
    on every try (the SDK gives up after its retries). The same user and prompt is the same
    request: deferred once, then queued."""
    controller = _shedding_controller(engine)
    running = controller.submit(_request("first-cold", _prompt(4, 1500), "s-first", max_tokens=64))
    with pytest.raises(EngineOverloaded):
        controller.submit(_request("anonymous", _prompt(5, 1500), None))
    retry = controller.submit(_request("anonymous-retry", _prompt(5, 1500), None))  # queued, not shed
    with pytest.raises(EngineOverloaded):  # another prompt is another request: shed as new
        controller.submit(_request("other", _prompt(6, 1500), None))
    assert running.collect(60)[1].error is None
    assert retry.collect(60)[1].error is None
    assert controller.stats()["queue_wait"]["cold"]["shed"] == 2
    assert_pool_clean(engine)
    controller.shutdown(5)


class _GatedSubmit:
    """The real engine, with submit() held at a gate: the moment between admission and engine."""

    def __init__(self, engine, fail_with: Exception | None = None):
        self.engine = engine
        self.fail_with = fail_with
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, request):
        self.entered.set()
        assert self.gate.wait(10)
        if self.fail_with is not None:
            raise self.fail_with
        return self.engine.submit(request)


def test_abort_between_admission_and_engine_submit_still_aborts(engine):
    gated = _GatedSubmit(engine)
    controller = AdmissionController(gated, AdmissionConfig(policy="fifo"))
    controller.start()
    stream = controller.submit(_request("r", _prompt(7, 40), "s", max_tokens=10_000))
    assert gated.entered.wait(10)
    stream.abort()  # dequeued already, not yet known to the engine
    gated.gate.set()
    _, final = stream.collect(30)
    assert final.finish_reason == "abort"
    assert controller.stats()["inflight_prefills"] == 0
    assert_pool_clean(engine)
    controller.shutdown(5)


def test_dispatcher_survives_an_unexpected_submit_error(engine):
    gated = _GatedSubmit(engine, fail_with=RuntimeError("boom"))
    gated.gate.set()
    controller = AdmissionController(gated, AdmissionConfig(policy="ikcode", max_cold_prefills=1))
    controller.start()
    _, final = controller.submit(_request("bad", _prompt(8, 400), "s")).collect(10)
    assert final.finish_reason == "error" and "boom" in str(final.error)
    assert controller.stats()["inflight_prefills"] == 0  # its cold slot came back
    gated.fail_with = None
    _, final = controller.submit(_request("good", _prompt(9, 400), "s2")).collect(30)
    assert final.error is None
    controller.shutdown(5)


def test_memory_gate_counts_tickets_admitted_earlier_in_the_same_round(engine):
    # Two cold prompts that each need most of the free pool: one admission round may not hand
    # both to the engine, or the second sits in the engine's queue where no warm turn can pass it.
    config = AdmissionConfig(policy="ikcode", max_cold_prefills=4, shed=False)
    controller = AdmissionController(engine, config)
    n = engine.num_blocks * engine.info.block_size * 6 // 10
    controller.submit(_request("a", _prompt(21, n), "sa"))
    controller.submit(_request("b", _prompt(22, n), "sb"))
    admitted = controller.policy.admit(0.0, controller._gate())
    assert [t.request_id for t in admitted] == ["a"]
    controller.shutdown(5)


def test_memory_gate_counts_the_whole_prompt_a_cache_hit_takes_from_the_pool():
    # A warm turn's cached prefix sits in the free pool while nobody runs it; once admitted, the
    # sequence holds it. Counting only its new tokens let a second prompt into the same round
    # that the engine then cannot allocate: it waits in the engine's queue, past admission.
    engine = tiny_engine(kv_memory_bytes=(3 << 20) // 2, max_prefill_tokens_per_step=256)
    try:
        block = engine.info.block_size
        assert engine.num_blocks * block == 3072
        prefix = _prompt(31, 1800)
        assert engine.submit(_request("prime", prefix, "s-warm")).collect(60)[1].error is None
        controller = AdmissionController(engine, AdmissionConfig(policy="ikcode", shed=False))
        controller.submit(_request("warm", prefix + _prompt(32, 20), "s-warm"))
        controller.submit(_request("other", _prompt(33, 1300), "s-other"))
        # warm: 114 blocks (113 of them cached), other: 82; the pool has 192.
        admitted = controller.policy.admit(0.0, controller._gate())
        assert [t.request_id for t in admitted] == ["warm"]
    finally:
        engine.shutdown(5)


def test_memory_gate_counts_tickets_handed_to_the_engine_in_an_earlier_round():
    # A request handed to the engine holds no blocks until the engine's next step allocates them,
    # so the engine's load does not show it: a gate that read only the load let the next round
    # hand over a prompt that then waited inside the engine, first come first served, where no
    # warm turn can pass it. The engine is not started here: nothing allocates until it steps.
    engine = tiny_engine(kv_memory_bytes=(3 << 20) // 2, max_prefill_tokens_per_step=256, start=False)
    config = AdmissionConfig(policy="ikcode", max_cold_prefills=4, shed=False)
    controller = AdmissionController(engine, config)
    try:
        assert engine.num_blocks * engine.info.block_size == 3072
        controller.submit(_request("a", _prompt(41, 1800), "sa"))  # 113 of the pool's 192 blocks
        [(ticket, stream)] = controller._admit_round()
        controller._start(ticket, stream)
        assert controller._unallocated == {"a": (0, 113)}
        controller.submit(_request("b", _prompt(42, 1800), "sb"))
        assert controller._admit_round() == []
        engine.step()  # a allocates: the engine's load shows it from now on, the promise ends
        assert controller._unallocated == {} and engine.load().kv_blocks_used == 113
        assert controller._admit_round() == []
    finally:
        controller.shutdown(5)
        engine.shutdown(5)


def test_the_gate_looks_a_queued_ticket_up_in_the_engine_again(engine):
    from ikcode.admission.gate import RankGate
    from ikcode.admission.policy import RequestClass, Ticket

    engine.start()
    base = _prompt(0, 600)
    assert engine.submit(_request("prime", base, "s")).collect(60)[1].error is None
    deadline = time.monotonic() + 10  # its blocks are committed when the engine releases it
    while engine.lookup(base).uncached_tokens > 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    gate = RankGate(engine)

    def ticket(prompt):
        return Ticket("t", len(prompt), 0, 0.0, RequestClass.WARM, payload=_request("t", prompt, "s"))

    assert gate.uncached(ticket(base + _prompt(3, 20))) <= 40  # the cached prefix counts
    assert gate.uncached(ticket(_prompt(9, 600))) == 600
