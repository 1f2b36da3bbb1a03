"""What each engine step runs: warm tails before cold prefills, short steps while others wait, no
starvation; and the scheduler as the one record of every sequence's state, through aborts at
every stage, without leaking a block. The engine is stepped by hand (its thread is not started),
so every step's batch is exact."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from ikcode.engines.base import EngineRequest, FinishReason, LifecycleKind, SamplingParams
from ikcode.engines.embedded.sequence import SequenceStatus
from tests.tiny_model import assert_pool_clean, tiny_engine

BUDGET = 64  # prefill tokens per step
CHUNK = 32  # at most this many a step for a prefill that cannot finish in one
ADMITTED, FIRST_TOKEN = LifecycleKind.ADMITTED, LifecycleKind.FIRST_TOKEN
FINISHED, RELEASED = LifecycleKind.FINISHED, LifecycleKind.RELEASED


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _engine(**config):
    """A stepped-by-hand engine whose steps record what they ran: [{request id: tokens}]."""
    config = {
        "kv_memory_bytes": 1 << 20,
        "max_prefill_tokens_per_step": BUDGET,
        "long_prefill_chunk_tokens": CHUNK,
        **config,
    }
    engine = tiny_engine(start=False, **config)
    engine.ran = []
    run = engine.runner.run

    def recording_run(scheduled):
        engine.ran.append({item.seq.seq_id: item.num_tokens for item in scheduled})
        return run(scheduled)

    engine.runner.run = recording_run
    return engine


def _submit(engine, request_id: str, prompt: list[int], max_tokens: int = 4):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return engine.submit(EngineRequest(request_id, prompt, params))


def _step_until(engine, done, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if done():
            return
        engine.step()
    raise AssertionError(f"not done after {max_steps} steps")


def _finish_all(engine) -> None:
    _step_until(engine, engine.idle)
    assert_pool_clean(engine)
    engine.shutdown()


def test_a_warm_tail_gets_its_first_token_from_a_step_without_cold_prefill():
    engine = _engine()
    _submit(engine, "cold", _prompt(1, 1000))
    engine.step()
    engine.step()  # the cold prefill is under way
    assert engine.ran == [{"cold": CHUNK}, {"cold": CHUNK}]
    tail = _submit(engine, "warm", _prompt(2, 20))
    engine.step()
    # The tail's step carries only the tail: its first token waits for 20 tokens, not 20 + a
    # share of the cold prompt's chunk.
    assert engine.ran[-1] == {"warm": 20}
    first = next(iter(tail))
    assert first.token_ids and not first.finished
    engine.step()  # the cold prefill sat out one step: now it runs beside the tail's decode
    assert engine.ran[-1] == {"warm": 1, "cold": CHUNK}
    _finish_all(engine)


@pytest.mark.parametrize("tail", [10, BUDGET], ids=["short tails", "tails that fill the budget"])
def test_a_stream_of_tails_never_starves_a_cold_prefill(tail: int):
    """Whether the tails leave budget over or the budget runs out before the loop reaches the
    cold prefill (it was never marked passed over, and sat out every step)."""
    engine = _engine()
    _submit(engine, "cold", _prompt(3, 600))
    cold_steps = 0
    for i in range(12):  # a new warm tail before every step
        _submit(engine, f"warm{i}", _prompt(10 + i, tail), max_tokens=1)
        engine.step()
        cold_steps += "cold" in engine.ran[-1]
        if i:  # never two steps in a row without the cold prefill
            assert "cold" in engine.ran[-1] or "cold" in engine.ran[-2], engine.ran
    assert cold_steps >= 6
    _finish_all(engine)


def test_a_long_prefill_runs_in_short_chunks_beside_decodes_and_alone():
    """A step is as long as the tokens in it, and whoever arrives during it waits for its end."""
    engine = _engine()
    _submit(engine, "agent", _prompt(4, 10), max_tokens=8)
    engine.step()  # its prefill
    _submit(engine, "cold", _prompt(5, 600))
    engine.step()
    assert engine.ran[-1] == {"agent": 1, "cold": CHUNK}
    _step_until(engine, lambda: engine.scheduler.get("agent") is None)
    engine.step()
    assert engine.ran[-1] == {"cold": CHUNK}  # alone too: a tail may arrive during any step
    _step_until(engine, lambda: engine.scheduler.get("cold").is_decoding)
    chunks = [ran["cold"] for ran in engine.ran if "cold" in ran]
    assert set(chunks[:-1]) == {CHUNK} and chunks[-1] <= BUDGET  # the last: what was left
    _finish_all(engine)


def test_admission_takes_every_seat_it_can_and_keeps_arrival_order_under_back_pressure():
    # 12 blocks of 16 tokens: the first two prompts take 10, the third must wait for blocks.
    engine = _engine(kv_memory_bytes=12 * 8192, max_num_seqs=4)
    for i, n in enumerate((80, 80, 100, 10)):
        _submit(engine, f"r{i}", _prompt(20 + i, n))
    engine.step()
    status = {sid: s.status for sid, s in engine.scheduler.seqs.items()}
    assert status == {
        "r0": SequenceStatus.RUNNING,
        "r1": SequenceStatus.RUNNING,
        "r2": SequenceStatus.WAITING,
        "r3": SequenceStatus.WAITING,  # it would fit, but it came after r2: no overtaking
    }
    load = engine.load()
    assert (load.running, load.waiting) == (2, 2)
    _finish_all(engine)


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding", "finished", "released"])
def test_abort_at_every_stage_ends_the_stream_once_and_leaks_nothing(stage: str):
    engine = _engine(release_lag_steps=3)
    table = engine.scheduler.seqs
    kinds: list[LifecycleKind] = []
    engine.add_listener(lambda e: kinds.append(e.kind))
    prompt = _prompt(6, 200)
    stream = _submit(engine, "r", prompt, max_tokens=6)
    assert table["r"].status is SequenceStatus.WAITING
    if stage != "waiting":
        engine.step()
        assert table["r"].status is SequenceStatus.RUNNING and table["r"].num_pending_tokens > 1
    if stage in ("decoding", "finished", "released"):
        _step_until(engine, lambda: table["r"].is_decoding)
    if stage in ("finished", "released"):
        _step_until(engine, lambda: table["r"].status is SequenceStatus.FINISHED)
        assert table["r"].block_table  # finished, not yet released: it still holds its blocks
    if stage == "released":
        _step_until(engine, lambda: "r" not in table)
    engine.abort("r")
    engine.step()
    events = list(stream)
    assert [e.finished for e in events].count(True) == 1
    final = events[-1]
    if stage in ("finished", "released"):
        assert final.finish_reason is FinishReason.LENGTH  # the abort came too late: a no-op
    else:
        assert final.finish_reason is FinishReason.ABORT
        assert "r" not in table  # an aborted sequence is released at once
    _step_until(engine, engine.idle)
    expected = {
        "waiting": [FINISHED],  # it never held blocks: nothing to release
        "prefilling": [ADMITTED, FINISHED, RELEASED],
        "decoding": [ADMITTED, FIRST_TOKEN, FINISHED, RELEASED],
        "finished": [ADMITTED, FIRST_TOKEN, FINISHED, RELEASED],
        "released": [ADMITTED, FIRST_TOKEN, FINISHED, RELEASED],
    }
    assert kinds == expected[stage]
    if stage in ("finished", "released"):  # committed at its release, as if never aborted
        block_size = engine.config.block_size
        assert engine.lookup(prompt).cached_tokens == len(prompt) // block_size * block_size
    _finish_all(engine)
    assert not table


def test_a_preempted_request_is_counted_once_in_the_cache_statistics():
    """Re-admitted after a preemption, a sequence hits the blocks it committed on its way out:
    that is no new request and no hit a client saw (4 unrelated prompts, all served cold, read
    as 7 requests at a 36% hit rate on /metrics)."""
    engine = tiny_engine(start=False, kv_memory_bytes=12 * 8192, max_num_seqs=4)
    preempted, released = [], threading.Semaphore(0)
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: preempted.append(seq.seq_id) or preempt(seq)
    engine.add_listener(lambda e: e.kind is LifecycleKind.RELEASED and released.release())
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    streams = [engine.submit(EngineRequest(f"r{i}", _prompt(20 + i, 50), params)) for i in range(4)]
    engine.start()
    finals = [stream.collect(60)[1] for stream in streams]
    assert all(released.acquire(timeout=30) for _ in streams)
    assert preempted, "no request was preempted: the test proves nothing"
    stats = engine.cache.stats
    assert sum(f.stats.cached_tokens for f in finals) == 0
    assert (stats.requests, stats.hit_tokens) == (4, 0)
    assert_pool_clean(engine)
    engine.shutdown()
