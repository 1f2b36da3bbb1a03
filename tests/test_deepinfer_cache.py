"""The prefix cache on DeepInfer (over the stand-in): a repeated conversation is served from
cache on every rank count, cached answers equal cold ones, the final-token commit serves 0%, the
host tier and the watermark eviction work, sessions stick to their rank."""

from __future__ import annotations

import pytest

from ikcode.engines.base import EngineRequest, SamplingParams
from ikcode.engines.deepinfer.rank_cache import RankCache
from tests.deepinfer_standin.harness import random_tokens, standin_engine, wait_released

TURN_OUTPUT = 24


def run(engine, request_id: str, prompt: list[int], session: str | None = None, timeout_s: float = 20):
    sampling = SamplingParams(max_tokens=TURN_OUTPUT)
    return engine.submit(EngineRequest(request_id, prompt, sampling, session_id=session)).collect(timeout_s)


def conversation(engine, session: str, seed: int, turns: int = 3, first_len: int = 3000, added: int = 300):
    """A conversation whose turn N+1 is turn N's prompt + reply + new text. Returns per turn
    (prompt, reply, final event, tokens reused from the previous turn)."""
    prompt = random_tokens(first_len, seed)
    out = []
    reused = 0
    for turn in range(turns):
        reply, final = run(engine, f"{session}-t{turn}", prompt, session)
        wait_released(engine)  # the commit happens at release, steps after the final token
        out.append((prompt, reply, final, reused))
        reused = len(prompt) + len(reply) + 1  # + the stripped EOS, when it stopped on EOS
        reused = min(reused, len(prompt) + len(reply) + (1 if len(reply) < TURN_OUTPUT else 0))
        prompt = prompt + reply + random_tokens(added, seed * 100 + turn)
    return out


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_repeated_conversation_served_from_cache_on_every_rank_count(ranks):
    engine = standin_engine(ranks=ranks)
    try:
        for s in range(ranks):  # one conversation per rank, at once
            turns = conversation(engine, f"sess{s}", seed=10 + s)
            for prompt, _reply, final, reused in turns[1:]:
                assert final.stats.cached_tokens >= 0.95 * reused, (final.stats, reused)
                assert final.stats.cached_tokens <= len(prompt) - 140  # the YOCO back-off
                assert final.stats.cached_tokens % 128 == 0
        stats = engine.cache_stats()
        assert stats["prefix_cache_hits_total"] > 0
        used = [w.cache.cache.stats.requests for w in engine.ranks]
        assert all(n > 0 for n in used), f"sessions did not spread over the ranks: {used}"
    finally:
        engine.shutdown(drain_timeout_s=1)


def test_cached_answer_equals_cold_answer():
    warm, cold = standin_engine(), standin_engine()
    try:
        turns = conversation(warm, "s", seed=3, turns=2)
        prompt, reply, final, _ = turns[1]
        assert final.stats.cached_tokens > 2500
        cold_reply, cold_final = run(cold, "cold", prompt)
        assert cold_final.stats.cached_tokens == 0
        assert reply == cold_reply
    finally:
        warm.shutdown(1)
        cold.shutdown(1)


@pytest.mark.parametrize("ranks", [1, 4])
def test_final_token_commit_serves_nothing(ranks):
    """The published regression: the entry finalised at the final token, while DeepInfer still
    holds the sequence for a step or more: nothing is committed when it really frees it."""
    engine = standin_engine(ranks=ranks, commit_point="final_token")
    try:
        turns = conversation(engine, "s", seed=5)
        for _prompt, _reply, final, _ in turns:
            assert final.stats.cached_tokens == 0
        assert engine.cache_stats()["prefix_cache_hits_total"] == 0
        assert sum(w.cache.num_pinned for w in engine.ranks) == 0
    finally:
        engine.shutdown(1)


def test_host_tier_serves_what_the_gpu_tier_evicted():
    # 40 GPU-tier slots per rank: the second conversation pushes the first one's blocks out to host.
    engine = standin_engine(num_gpu_blocks=96, gpu_tier_fraction=0.42, host_tier_blocks_per_rank=256)
    try:
        a = random_tokens(3000, 1)
        b = random_tokens(3000, 2)
        reply_a, _ = run(engine, "a1", a, "A")
        wait_released(engine)
        run(engine, "b1", b, "B")
        wait_released(engine)
        stats = engine.cache_stats()
        assert stats["prefix_cache_demoted_blocks_total"] > 0
        again = a + reply_a + random_tokens(300, 9)
        reply, final = run(engine, "a2", again, "A")
        wait_released(engine)
        assert final.stats.cached_tokens_host > 0
        assert final.stats.cached_tokens >= 0.95 * (len(a) + len(reply_a))
        cold = standin_engine()
        try:
            assert run(cold, "c", again)[0] == reply  # pages and state restored exactly
        finally:
            cold.shutdown(1)
    finally:
        engine.shutdown(1)


def test_eviction_keeps_prefill_admission_above_the_watermark(monkeypatch):
    """Pinned cache blocks push block usage past 90%: DeepInfer stalls every prefill
    (scheduler.hpp:80, 313). The adapter unpins before the step, so new work still runs."""
    engine = standin_engine(num_gpu_blocks=64, gpu_tier_fraction=0.85, prime_min_tokens=0)
    try:
        for i in range(7):  # 7 x 10 blocks to pin, 53 GPU-tier slots, 63 usable blocks
            run(engine, f"r{i}", random_tokens(1300, 40 + i), f"S{i}")
            wait_released(engine)
        w = engine.ranks[0]
        assert w.cache.cache.stats.evicted_blocks > 0
        assert w.scheduler.get_num_free_blocks() >= w.reserve_blocks
    finally:
        engine.shutdown(1)
    # The same without the eviction: the sixth prompt is allocated but never prefilled.
    monkeypatch.setattr(RankCache, "evict_for", lambda self, n: 0)
    engine = standin_engine(num_gpu_blocks=64, gpu_tier_fraction=0.85, prime_min_tokens=0)
    try:
        for i in range(5):
            run(engine, f"r{i}", random_tokens(1300, 40 + i), f"S{i}")
            wait_released(engine)
        with pytest.raises(TimeoutError):
            run(engine, "r5", random_tokens(1300, 45), "S5", timeout_s=1.0)
        assert engine.ranks[0].scheduler.usage() > 0.9
        wait_released(engine)  # the abort freed it: nothing leaked
    finally:
        engine.shutdown(1)


def test_sessions_stick_to_their_rank_and_the_load_guard_moves_them():
    engine = standin_engine(ranks=2, affinity_max_imbalance=0)
    try:
        run(engine, "x1", random_tokens(1000, 7), "X")
        wait_released(engine)
        owner = [w.rank for w in engine.ranks if w.cache.cache.stats.requests]
        assert len(owner) == 1
        # A prompt sharing the prefix but without a session id goes where the prefix lives.
        _, final = run(engine, "x2", random_tokens(1000, 7) + random_tokens(300, 8))
        wait_released(engine)
        assert final.stats.cached_tokens > 0
        assert engine.router.route("X", lambda r: 0, lambda r: 0) == owner[0]
        # The owner is busier than the other rank by more than the guard allows: moved.
        assert engine.router.route("X", lambda r: 0, lambda r: 5 if r == owner[0] else 0) != owner[0]
    finally:
        engine.shutdown(1)


def test_priming_makes_identical_and_short_follow_up_prompts_resumable():
    """Only a sequence's last 128 boundary keeps its window, and a resume leaves KEEP tokens to
    replay: without the priming pass an identical repeat (doctor's quality gate) could never hit."""
    engine, plain = standin_engine(), standin_engine(prime_min_tokens=0)
    try:
        prompt = random_tokens(3000, 21)
        first, cold = run(engine, "a", prompt, "A")
        wait_released(engine)
        assert cold.stats.cached_tokens == 0 and cold.stats.computed_tokens == 3000  # primed, still cold
        assert run(plain, "p", prompt)[0] == first  # the priming pass changes no answer
        again, warm = run(engine, "b", prompt, "A")
        wait_released(engine)
        assert warm.stats.cached_tokens == (3000 - 140) // 128 * 128 and again == first
        follow = prompt + first + random_tokens(20, 22)  # fewer new tokens than KEEP
        _, short = run(engine, "c", follow, "A")
        wait_released(engine)
        assert short.stats.cached_tokens >= 0.9 * len(follow)
        assert engine.cache_stats()["prefix_cache_requests_total"] == 3  # priming passes not counted
        # Without priming the identical repeat finds no resumable boundary at all.
        run(plain, "p2", prompt)
        wait_released(plain)
        assert run(plain, "p3", prompt)[1].stats.cached_tokens == 0
    finally:
        engine.shutdown(1)
        plain.shutdown(1)
