"""The prefix cache on DeepInfer's real engine core: the host tier (the node's shared pool)
serves what the GPU tier evicted, with the restored pages and window giving the same answer as a
cold run; eviction keeps DeepInfer's prefill admission open."""

from __future__ import annotations

import pytest

from tests.deepinfer_build.harness import (
    assert_no_leaks,
    finished_normally,
    random_tokens,
    real_engine,
    run,
    wait_quiet,
)

pytestmark = pytest.mark.deepinfer


def test_host_tier_serves_what_the_gpu_tier_evicted(tmp_path):
    # 40 GPU-tier slots: the second conversation pushes the first one's blocks out to the host pool.
    engine = real_engine(tmp_path, blocks=96, gpu_tier_fraction=0.42, host_tier_blocks_per_rank=256)
    try:
        assert engine.host_pool is not None
        a, b = random_tokens(3000, 1), random_tokens(3000, 2)
        reply_a, _ = run(engine, "a1", a, session="A")
        wait_quiet(engine)
        run(engine, "b1", b, session="B")
        wait_quiet(engine)
        assert engine.cache_stats()["prefix_cache_demoted_blocks_total"] > 0
        again = a + reply_a + random_tokens(300, 9)
        reply, final = run(engine, "a2", again, session="A")
        assert finished_normally(final)
        assert final.stats.cached_tokens_host > 0, final.stats
        cached = final.stats.cached_tokens_device + final.stats.cached_tokens_host
        assert cached >= 0.95 * (len(a) + len(reply_a)), final.stats
        assert_no_leaks(wait_quiet(engine))
    finally:
        engine.shutdown(drain_timeout_s=5)
    cold = real_engine(tmp_path / "cold", blocks=96)
    try:
        assert run(cold, "c", again)[0] == reply  # pages and window restored exactly
    finally:
        cold.shutdown(drain_timeout_s=5)


@pytest.mark.parametrize("host_pages", [0, 64], ids=["no host tier", "host tier"])
def test_eviction_keeps_prefill_admission_above_the_watermark(tmp_path, host_pages):
    """Pinned cache blocks would push block usage past 90%, where DeepInfer admits no prefill
    (scheduler.hpp:80, 313): the adapter unpins before the step, so new work keeps running.
    With a host tier the evicted blocks are copied out first, and stay pinned until their copy
    has run: admission must not count them free before that (a request then failed with 529)."""
    engine = real_engine(
        tmp_path, blocks=64, gpu_tier_fraction=0.85, prime_min_tokens=0, host_tier_blocks_per_rank=host_pages
    )
    try:
        for i in range(7):  # 7 x 10 blocks to pin, 53 GPU-tier slots, 63 usable blocks
            _, final = run(engine, f"r{i}", random_tokens(1300, 40 + i), session=f"S{i}")
            assert finished_normally(final), final
            wait_quiet(engine)
        assert engine.cache_stats()["prefix_cache_evicted_blocks_total"] > 0
        (check,) = wait_quiet(engine)
        assert check["blocks_free"] >= 0.1 * check["blocks_total"], check
        assert_no_leaks([check])
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_window_snapshots_go_with_their_keys_and_stay_within_their_budget(tmp_path):
    """Each committed resume point keeps the window state at its 128 boundary, in host memory
    outside both tiers. A snapshot whose block left both tiers serves nothing: it must go (40
    conversations through 96 blocks and 16 host pages left 28 of 40 for keys no tier held), and
    all of them stay within snapshot_bytes_per_rank."""
    engine = real_engine(tmp_path, blocks=96, host_tier_blocks_per_rank=16, prime_min_tokens=0)
    try:
        for i in range(40):
            assert finished_normally(run(engine, f"r{i}", random_tokens(700, 100 + i), max_tokens=8)[1])
        (check,) = wait_quiet(engine)
        assert engine.cache_stats()["prefix_cache_dropped_blocks_total"] > 0  # keys did leave both tiers
        assert check["snapshots"] > 0
        assert check["snapshots_lost_keys"] == 0, check
        size = check["snapshot_bytes"] // check["snapshots"]
    finally:
        engine.shutdown(drain_timeout_s=5)
    budget = 3 * size  # room for three snapshots
    small = real_engine(tmp_path / "small", blocks=96, prime_min_tokens=0, snapshot_bytes_per_rank=budget)
    try:
        for i in range(8):
            run(small, f"s{i}", random_tokens(700, 200 + i), max_tokens=8)
        (check,) = wait_quiet(small)
        assert 0 < check["snapshot_bytes"] <= budget, check
        # the latest conversation's resume point is among the kept ones: its next turn hits
        last = random_tokens(700, 207)
        _, final = run(small, "s7-again", last + random_tokens(300, 9), max_tokens=4)
        assert final.stats.cached_tokens_device >= 512, final.stats
    finally:
        small.shutdown(drain_timeout_s=5)


def test_the_host_tier_is_sized_by_the_measured_page(tmp_path):
    """host_tier_bytes_per_rank is divided by the page each rank measured (one row of its
    gpu_blocks), not by the profile's estimate: the pool allocated stays within the bytes."""
    budget = 1_000_000
    engine = real_engine(tmp_path, ranks=2, blocks=96, host_tier_bytes_per_rank=budget)
    try:
        page = int(engine.ranks[0].info["page_bytes"])
        assert engine.host_pool is not None
        assert engine.host_pool.page_bytes == page
        assert engine.host_pool.num_pages == 2 * (budget // page)
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_blocks_evicted_for_the_watermark_are_remembered_when_asked_for_again(tmp_path):
    """The watermark eviction (the adapter's main one) dropped keys without the ghost list: the
    regret metric (a dropped prefix asked for again) never counted what it evicted."""
    engine = real_engine(tmp_path, blocks=64, gpu_tier_fraction=0.6, prime_min_tokens=0)
    try:
        first = random_tokens(1800, 81)
        run(engine, "a1", first, max_tokens=8, session="a")
        wait_quiet(engine)
        for n in range(3):  # newer conversations push the first one's blocks out (no host tier)
            run(engine, f"x{n}", random_tokens(3000, 82 + n), max_tokens=8, session=f"x{n}")
            wait_quiet(engine)
        stats = engine.cache_stats()
        assert stats["prefix_cache_evicted_blocks_total"] > 0
        assert stats["prefix_cache_dropped_blocks_total"] == stats["prefix_cache_evicted_blocks_total"]
        run(engine, "a2", first, max_tokens=8, session="a")
        assert engine.cache_stats()["prefix_cache_regret_blocks_total"] > 0
        assert_no_leaks(wait_quiet(engine))
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_the_cache_counts_the_hits_its_requests_report(tmp_path):
    """With priming passes and both tiers in play, the cache's hit counters are the sum of what
    its requests report as served from it (a priming pass's own hits are nobody's; what it
    computed for a request a moment before is not a hit of that request)."""
    engine = real_engine(tmp_path, blocks=96, gpu_tier_fraction=0.42, host_tier_blocks_per_rank=256)
    reported = 0
    try:
        a, b = random_tokens(3000, 11), random_tokens(3000, 12)
        prompts = [("a1", a, "A"), ("b1", b, "B")]
        for rid, prompt, session in prompts:
            reply, final = run(engine, rid, prompt, session=session)
            reported += final.stats.cached_tokens_device + final.stats.cached_tokens_host
            wait_quiet(engine)
        for n, (prompt, session) in enumerate(((a, "A"), (b, "B"), (a, "A"))):
            longer = prompt + random_tokens(700, 20 + n)
            _, final = run(engine, f"again{n}", longer, session=session)
            assert finished_normally(final)
            reported += final.stats.cached_tokens_device + final.stats.cached_tokens_host
            wait_quiet(engine)
        stats = engine.cache_stats()
    finally:
        engine.shutdown(drain_timeout_s=5)
    assert reported > 0
    assert stats["prefix_cache_hits_total"] == reported, stats
