"""The DeepInfer adapter against DeepInfer's real engine core (deepinfer._C built from the
deepinfer==0.1.0 sdist on this CPU, tests/deepinfer_build/), its own LLMEngine and Worker step
loop, in one OS process per data-parallel rank. Only the GPU parts are replaced (see
tests/deepinfer_build/cpu_runtime.py); the CPU model's tokens depend on the KV pages and the
sliding window it reads, so a wrong resume changes the answer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ikcode.engines.base import EngineError, EngineRequest, FinishReason, SamplingParams
from tests.deepinfer_build import cpu_backend
from tests.deepinfer_build.harness import (
    assert_no_leaks,
    built_core,
    finished_normally,
    random_tokens,
    real_engine,
    run,
    wait_quiet,
)

pytestmark = pytest.mark.deepinfer


def test_one_request_through_the_real_engine(tmp_path):
    engine = real_engine(tmp_path)
    try:
        tokens, final = run(engine, "a", random_tokens(300, 1), max_tokens=8)
        assert finished_normally(final), final
        assert len(tokens) == 8
        assert_no_leaks(wait_quiet(engine))
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_cold_and_warm_answers_are_token_identical(tmp_path):
    """A true cold run (no cache, no priming pass: every position computed) against the same
    prompt served warm from the cache (pages copied, window restored, the last 140+ tokens
    replayed): the answers must be identical at temperature 0."""
    prompt = random_tokens(1500, 2)
    plain = real_engine(tmp_path / "plain", prime_min_tokens=0)
    try:
        cold, final = run(plain, "cold", prompt, max_tokens=24)
        assert finished_normally(final) and final.stats.cached_tokens_device == 0
    finally:
        plain.shutdown(drain_timeout_s=5)
    engine = real_engine(tmp_path / "cached")
    try:
        first, _ = run(engine, "first", prompt, max_tokens=24)  # its priming pass fills the cache
        wait_quiet(engine)
        # another conversation in between takes a state slot and the freed blocks
        run(engine, "other", random_tokens(1500, 3), max_tokens=24)
        wait_quiet(engine)
        warm, second = run(engine, "warm", prompt, max_tokens=24)
        assert finished_normally(second)
        assert second.stats.cached_tokens_device == (1500 - 140) // 128 * 128, second.stats  # resumed
        assert warm == cold and first == cold
        assert_no_leaks(wait_quiet(engine))
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_two_rank_processes_step_in_lockstep_with_an_idle_rank(tmp_path):
    engine = real_engine(tmp_path, ranks=2)
    try:
        pids = {r.process.pid for r in engine.ranks}
        assert len(pids) == 2 and all(r.process.is_alive() for r in engine.ranks)
        tokens, final = run(engine, "only", random_tokens(600, 3), max_tokens=32, session="s")
        assert finished_normally(final) and len(tokens) == 32
        checks = wait_quiet(engine)
        busy = [c for c in checks if c["forward_tokens"] > 0]
        idle = [c for c in checks if c["forward_tokens"] == 0]
        assert len(busy) == 1 and len(idle) == 1, checks
        # The idle rank stepped with the busy one (placeholder steps), and the two loops stayed
        # within one iteration of each other: every iteration is a collective of both.
        assert idle[0]["placeholder_steps"] >= 32, checks
        assert abs(checks[0]["steps"] - checks[1]["steps"]) <= 1, checks
        assert_no_leaks(checks)
    finally:
        engine.shutdown(drain_timeout_s=5)
    assert all(not r.process.is_alive() for r in engine.ranks)
    assert [r.process.exitcode for r in engine.ranks] == [0, 0]


def conversation_turn(history: list[int], turn: int, seed: int) -> list[int]:
    return history + random_tokens(64, seed * 1000 + turn)


def test_twenty_turn_conversations_read_each_repeat_from_cache(tmp_path):
    """Two conversations (one per rank), 20 turns each: every turn repeats the previous prompt
    and answer, and >= 95% of that repeat must come from the cache."""
    engine = real_engine(tmp_path, ranks=2, blocks=200, max_model_len=16384)
    try:
        worst = 1.0
        for seed, session in ((1, "conv-a"), (2, "conv-b")):
            history = random_tokens(4096, seed)
            for turn in range(20):
                prompt = conversation_turn(history, turn, seed)
                answer, final = run(engine, f"{session}-{turn}", prompt, max_tokens=16, session=session)
                assert finished_normally(final), final
                if turn:
                    cached = final.stats.cached_tokens_device + final.stats.cached_tokens_host
                    worst = min(worst, cached / len(history))
                history = prompt + answer
                wait_quiet(engine)  # the turn is committed when DeepInfer frees the sequence
        print(f"worst turn: {worst:.1%} of the repeat served from cache")
        assert worst >= 0.95, worst
        checks = wait_quiet(engine)
        assert all(c["forward_tokens"] > 0 for c in checks), checks  # both ranks served
        assert_no_leaks(checks)
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_a_rank_that_dies_is_detected_and_reported(tmp_path):
    """Rank processes wait for each other in every step: when one dies, its requests and the
    others' fail at once with the reason, nothing hangs, and the engine refuses new work."""
    engine = real_engine(tmp_path, ranks=2)
    try:
        stream = engine.submit(
            EngineRequest("long", random_tokens(300, 9), SamplingParams(temperature=0.0, max_tokens=5000))
        )
        next(iter(stream))  # it is running
        victim = engine.ranks[1].process
        os.kill(victim.pid, signal.SIGKILL)
        started = time.monotonic()
        tokens, final = stream.collect(60)
        assert final.finish_reason is FinishReason.ERROR and "rank 1 exited" in str(final.error), final
        assert time.monotonic() - started < 30
        with pytest.raises(EngineError, match="rank 1 exited"):
            engine.submit(EngineRequest("after", random_tokens(10, 1), SamplingParams(max_tokens=2)))
    finally:
        engine.shutdown(drain_timeout_s=5)
    assert all(not r.process.is_alive() for r in engine.ranks)


@pytest.mark.parametrize("ranks", [1, 4])
def test_engine_args_split_the_experts_and_keep_preemption_final(tmp_path, ranks):
    """What one rank's EngineArgs make of it, in DeepInfer's own create_engine_configs: the
    experts split over the ranks (the default, 1, puts them all on every card), preempted
    requests stopped whatever the profile says (the adapter's preemption path expects it). With
    one rank, on DeepInfer's real scheduler: a stall-guard hand-back leaves the state slot's id on
    the Sequence, which must be reset for the retry to allocate; a prompt add_request refuses
    gives None, and no output ever comes for it (the adapter fails it at once)."""
    built_core()
    model = cpu_backend.write_model_dir(tmp_path / "model")
    probe = subprocess.run(
        [sys.executable, "-m", "tests.deepinfer_build.engine_args_probe", str(model), str(ranks)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    out = json.loads(probe.stdout.strip().splitlines()[-1])
    assert out["expert_parallel_size"] == out["data_parallel_size"] == ranks
    assert out["stop_preempted_request"] is True
    if ranks == 1:
        assert out["state_id_after_free"] != -1 and out["retry_allocated"] is True
        assert out["refused_prompt"] is True


def test_the_merged_hit_rate_is_the_ranks_hits_over_their_queries(tmp_path):
    """The ranks' hit rates were added up with their counters: four ranks at 0.8 read 3.2."""
    engine = real_engine(tmp_path, ranks=2)
    try:
        for session, seed in (("a", 1), ("b", 2)):
            prompt = random_tokens(1500, seed)
            for turn in range(2):  # the repeat reads the prompt from its rank's cache
                tokens, final = run(engine, f"{session}{turn}", prompt, max_tokens=4, session=session)
                assert finished_normally(final)
                wait_quiet(engine)
        stats = engine.cache_stats()
    finally:
        engine.shutdown(drain_timeout_s=5)
    assert stats["prefix_cache_hits_total"] > 0
    expected = stats["prefix_cache_hits_total"] / stats["prefix_cache_queries_total"]
    assert abs(stats["prefix_cache_hit_rate"] - expected) < 1e-9, stats
