"""The adapter's lifecycle on the stand-in: EOS stripped, stop ids and max_tokens enforced,
aborts (queued, waiting, running), engine rejections and failures: never a leaked block or slot."""

from __future__ import annotations

import random
import time

import pytest

from ikcode.engines.base import (
    EngineError,
    EngineRequest,
    EngineShutdown,
    FinishReason,
    LifecycleKind,
    PromptTooLong,
    SamplingParams,
)
from tests import deepinfer_standin as di
from tests.deepinfer_standin.harness import random_tokens, standin_engine, wait_released


@pytest.fixture
def engine():
    engine = standin_engine(ranks=2)
    yield engine
    engine.shutdown(drain_timeout_s=1)


def submit(engine, rid, prompt, **sampling):
    return engine.submit(EngineRequest(rid, prompt, SamplingParams(**sampling), session_id=rid))


def test_eos_is_stripped_and_max_tokens_is_enforced(engine):
    stopped = None
    for seed in range(60):
        tokens, final = submit(engine, f"r{seed}", random_tokens(200, seed), max_tokens=40).collect(10)
        assert di.EOS_TOKEN_ID not in tokens
        assert len(tokens) <= 40
        if final.finish_reason is FinishReason.STOP:
            stopped = tokens
            break
        assert final.finish_reason is FinishReason.LENGTH and len(tokens) == 40
    assert stopped is not None, "no reply ended on EOS"
    tokens, final = submit(engine, "five", random_tokens(200, 999), max_tokens=5).collect(10)
    assert final.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) and len(tokens) <= 5
    wait_released(engine)


def test_stop_token_ids_end_the_reply_and_the_engine_request(engine):
    prompt = random_tokens(300, 4)
    full, _ = submit(engine, "full", prompt, max_tokens=30).collect(10)
    stop = full[5]
    cut, final = submit(engine, "cut", prompt, max_tokens=30, stop_token_ids=(stop,)).collect(10)
    assert cut == full[: full.index(stop)] and final.finish_reason is FinishReason.STOP
    wait_released(engine)


def test_aborts_at_every_stage_leak_nothing():
    """Queued in the adapter, waiting in the engine, prefilling, decoding, finished-not-freed."""
    engine = standin_engine(ranks=2, max_num_seqs=2, chunked_prefill=256)
    released = []
    engine.add_listener(lambda e: released.append(e.request_id) if e.kind is LifecycleKind.RELEASED else None)
    rng = random.Random(7)
    try:
        streams = []
        for i in range(24):
            prompt = random_tokens(rng.choice([150, 700, 2500]), i % 5)  # shared prefixes too
            streams.append(submit(engine, f"r{i}", prompt, max_tokens=rng.choice([3, 60, 400])))
            if rng.random() < 0.7:
                time.sleep(rng.random() * 0.01)
                streams[rng.randrange(len(streams))].abort()
        finals = [s.collect(20)[1] for s in streams]
        assert {f.finish_reason for f in finals} >= {FinishReason.ABORT}
        wait_released(engine)
        assert sorted(released) == sorted(f"r{i}" for i in range(24))
    finally:
        engine.shutdown(1)


def test_abort_of_a_running_request_closes_its_stream(engine):
    stream = submit(engine, "long", random_tokens(500, 3), max_tokens=5000)
    first = next(iter(stream))
    assert first.token_ids
    stream.abort()
    tokens, final = stream.collect(10)
    assert final.finish_reason is FinishReason.ABORT
    wait_released(engine)


def test_engine_rejection_is_an_error_and_its_echo_is_not_streamed(engine):
    engine.config.max_model_len = 10**6  # let a prompt past DeepInfer's own limit through
    tokens, final = submit(engine, "big", random_tokens(33000, 1)).collect(10)
    assert tokens == [] and final.finish_reason is FinishReason.ERROR
    assert isinstance(final.error, PromptTooLong)
    wait_released(engine)


def test_failed_state_load_fails_the_request_and_frees_it(engine):
    prompt = random_tokens(1500, 2)
    reply, _ = submit(engine, "a", prompt, max_tokens=8).collect(10)
    wait_released(engine)
    for w in engine.ranks:
        w.engine.cache_engine.fail_next_state_load = True
    _, final = submit(engine, "a", prompt + reply + random_tokens(300, 3)).collect(10)
    assert final.finish_reason is FinishReason.ERROR and isinstance(final.error, EngineError)
    wait_released(engine)
    for w in engine.ranks:
        w.engine.cache_engine.fail_next_state_load = False
    _, final = submit(engine, "again", prompt + reply + random_tokens(300, 3)).collect(10)
    assert final.finish_reason is not FinishReason.ERROR and final.stats.cached_tokens > 1000
    wait_released(engine)


def test_unpatched_deepinfer_says_what_to_do(engine, monkeypatch):
    monkeypatch.setattr(di.Sequence, "block_table_bound", False)
    _, final = submit(engine, "x", random_tokens(300, 1)).collect(10)
    assert final.finish_reason is FinishReason.ERROR and "patch" in str(final.error)
    monkeypatch.setattr(di.Sequence, "block_table_bound", True)
    wait_released(engine)


def test_shutdown_aborts_what_runs_and_stops_every_rank():
    engine = standin_engine(ranks=3, chunked_prefill=128)
    stream = submit(engine, "long", random_tokens(20000, 1), max_tokens=100000)  # ~150 prefill steps
    time.sleep(0.05)
    engine.shutdown(drain_timeout_s=0.0)
    _, final = stream.collect(5)
    assert final.finish_reason is FinishReason.ABORT and isinstance(final.error, EngineShutdown)
    assert not any(t.is_alive() for t in engine._threads)
    with pytest.raises(EngineShutdown):
        submit(engine, "late", [5, 6, 7])


def test_bad_input_is_refused_synchronously(engine):
    with pytest.raises(PromptTooLong):
        submit(engine, "long", [5] * 40000)
    with pytest.raises(EngineError):
        submit(engine, "oov", [5, 400])


def test_commit_survives_a_from_engine_args_that_ignores_the_subclass(monkeypatch):
    from tests.deepinfer_standin import llm_engine

    base_only = classmethod(lambda cls, args: llm_engine.LLMEngine(args))
    monkeypatch.setattr(llm_engine.LLMEngine, "from_engine_args", base_only)
    engine = standin_engine()
    try:
        prompt = random_tokens(2000, 3)
        reply, _ = submit(engine, "a", prompt, max_tokens=8).collect(10)
        wait_released(engine)
        _, final = submit(engine, "b", prompt + reply + random_tokens(300, 4)).collect(10)
        assert final.stats.cached_tokens >= 0.95 * len(prompt)
        wait_released(engine)
    finally:
        engine.shutdown(1)
