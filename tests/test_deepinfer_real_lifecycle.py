"""The adapter's lifecycle on DeepInfer's real engine core: the cache commit in finalize_seq,
aborts at every stage, a forced preemption; never a leaked block or state slot."""

from __future__ import annotations

import threading
import time

import pytest

from ikcode.engines.base import EngineRequest, FinishReason, LifecycleKind, SamplingParams
from tests.deepinfer_build.harness import (
    assert_no_leaks,
    finished_normally,
    random_tokens,
    real_engine,
    run,
    wait_quiet,
)

pytestmark = pytest.mark.deepinfer


@pytest.mark.parametrize("commit_point", ["release", "final_token"])
def test_the_cache_is_committed_in_finalize_seq(tmp_path, commit_point):
    """DeepInfer reports finished=True a step or more before finalize_seq frees the sequence
    (llm_engine.py:803-805, scheduler.hpp:549): committing when the final token is seen finds
    nothing left to commit. Only the commit inside finalize_seq fills the cache."""
    engine = real_engine(tmp_path, commit_point=commit_point)
    try:
        prompt = random_tokens(2000, 7)
        first, _ = run(engine, "first", prompt, max_tokens=16)
        wait_quiet(engine)
        second, final = run(engine, "second", prompt, max_tokens=16)
        assert second == first
        cached = final.stats.cached_tokens_device
        if commit_point == "release":
            # all of it that can be resumed: 128-aligned, KEEP (140) tokens left to replay
            assert cached == (len(prompt) - 140) // 128 * 128 == 1792, final.stats
        else:
            assert cached == 0, final.stats  # the published silent miss, reproduced
        stats = engine.cache_stats()
        assert stats["commit_failures"] == 0
        assert_no_leaks(wait_quiet(engine))
    finally:
        engine.shutdown(drain_timeout_s=5)


def submit(engine, rid, prompt, max_tokens=16):
    return engine.submit(EngineRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)))


def until(predicate, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_aborts_at_every_stage_leak_nothing(tmp_path):
    engine = real_engine(tmp_path, max_num_seqs=2, max_num_batched_tokens=512, blocks=128, prime_min_tokens=0)
    admitted: set[str] = set()
    seen = threading.Lock()

    def listen(event):
        if event.kind is LifecycleKind.ADMITTED:
            with seen:
                admitted.add(event.request_id)

    engine.add_listener(listen)
    try:
        # 1. before admission: the abort follows the submit down the same pipe
        s = submit(engine, "queued", random_tokens(300, 1))
        s.abort()
        assert s.collect(60)[1].finish_reason is FinishReason.ABORT
        # 2. in a chunked prefill (4,000 tokens, 512 per step); 3. just handed to DeepInfer's
        # scheduler behind it (WAITING, or in its first chunk by the time the abort lands)
        running = submit(engine, "prefill", random_tokens(4000, 2), max_tokens=400)
        until(lambda: "prefill" in admitted)
        waiting = submit(engine, "waiting", random_tokens(3000, 3), max_tokens=400)
        until(lambda: "waiting" in admitted)
        waiting.abort()
        running.abort()
        assert waiting.collect(60)[1].finish_reason is FinishReason.ABORT
        assert running.collect(60)[1].finish_reason is FinishReason.ABORT
        # 4. running, decoding: abort after the first tokens
        decoding = submit(engine, "decode", random_tokens(300, 4), max_tokens=2000)
        first = next(iter(decoding))
        assert first.token_ids and not first.finished
        decoding.abort()
        tokens, final = decoding.collect(60)
        assert final.finish_reason is FinishReason.ABORT and len(tokens) < 2000
        # 5. finished (the engine may still hold it): a late abort changes nothing
        done = submit(engine, "done", random_tokens(300, 5), max_tokens=4)
        tokens, final = done.collect(60)
        done.abort()
        assert finished_normally(final) and len(tokens) == 4
        assert_no_leaks(wait_quiet(engine))
        assert engine.cache_stats()["commit_failures"] == 0
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_a_forced_preemption_is_reported_and_leaks_nothing(tmp_path):
    """Two long answers outgrow 40 KV blocks: DeepInfer stops one (FINISHED_PREEMPTED), frees its
    blocks and state without finalize_seq and echoes its last token (scheduler.hpp:766-790,
    outputs.hpp:297-304). The client gets an error, not the echo; the other answer completes."""
    engine = real_engine(tmp_path, blocks=40, max_model_len=4000, gpu_tier_fraction=0.1)
    try:
        a = submit(engine, "a", random_tokens(2000, 11), max_tokens=1500)
        b = submit(engine, "b", random_tokens(2000, 12), max_tokens=1500)
        results = {"a": a.collect(300), "b": b.collect(300)}
        errors = {k: v for k, v in results.items() if v[1].error is not None}
        assert len(errors) == 1, {k: (len(v[0]), v[1].finish_reason) for k, v in results.items()}
        ((lost, (tokens, final)),) = errors.items()
        assert final.finish_reason is FinishReason.ERROR and "out of KV memory" in str(final.error)
        other = results["b" if lost == "a" else "a"]
        assert finished_normally(other[1])
        assert engine.cache_stats()["preempted"] == 1
        assert_no_leaks(wait_quiet(engine))
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_a_failed_commit_is_counted_and_logged_not_swallowed(tmp_path, capfd):
    """The cache work in finalize_seq raises (here: reading the sliding window fails): DeepInfer
    still frees the sequence, the answer is unaffected, and the failure shows in cache_stats
    (/metrics: ikcode_cache_commit_failures, which `ikcode doctor` fails on)."""
    from tests.deepinfer_build.cpu_runtime import ENV_FAIL_STATE_READ

    engine = real_engine(tmp_path, environment={ENV_FAIL_STATE_READ: "1"}, prime_min_tokens=0)
    try:
        tokens, final = run(engine, "x", random_tokens(1000, 5), max_tokens=8)
        assert finished_normally(final) and len(tokens) == 8
        checks = wait_quiet(engine)
        assert engine.cache_stats()["commit_failures"] == 1
        assert_no_leaks(checks)
        assert "cache commit failed in finalize_seq (RuntimeError" in capfd.readouterr().err  # the rank's log
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_shutdown_with_a_live_request_ends_it_and_no_reader_thread_dies(tmp_path, monkeypatch):
    """At shutdown the rank ends each live request with EngineShutdown and sends it through its
    pipe; the error did not unpickle, and the thread that reads the pipe died of it."""
    from tests.deepinfer_build.cpu_runtime import ENV_STEP_SECONDS

    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    engine = real_engine(tmp_path, environment={ENV_STEP_SECONDS: "0.01"}, prime_min_tokens=0)
    decoding = threading.Event()
    engine.add_listener(lambda event: event.kind is LifecycleKind.FIRST_TOKEN and decoding.set())
    stream = submit(engine, "long", random_tokens(500, 21), max_tokens=5000)
    assert decoding.wait(60)
    engine.shutdown(drain_timeout_s=0.2)
    _, final = stream.collect(30)
    assert final.finish_reason in (FinishReason.ABORT, FinishReason.ERROR), final
    assert "shutting down" in str(final.error)
    assert died == []


def test_a_rank_hung_in_a_step_fails_its_requests_and_the_engine_says_why(tmp_path):
    """A step that never returns (here: the CPU model's forward sleeps 60 s) kept the rank alive
    and its pipe open: its requests waited forever and every call to it timed out one by one."""
    from ikcode.engines.base import EngineError
    from tests.deepinfer_build.cpu_runtime import ENV_STEP_SECONDS

    engine = real_engine(tmp_path, environment={ENV_STEP_SECONDS: "60"}, hung_rank_s=2.0, prime_min_tokens=0)
    try:
        began = time.monotonic()
        _, final = submit(engine, "stuck", random_tokens(300, 31), max_tokens=8).collect(60)
        assert final.finish_reason is FinishReason.ERROR, final
        assert "rank 0 sent nothing for 2 s" in str(final.error)
        assert time.monotonic() - began < 30  # the watchdog's 2 s and the rank's stop, not the 60 s step
        with pytest.raises(EngineError, match="hung in a step"):
            submit(engine, "next", random_tokens(10, 1))
    finally:
        engine.shutdown(drain_timeout_s=1)
    assert not any(r.process.is_alive() for r in engine.ranks)  # nothing left running
