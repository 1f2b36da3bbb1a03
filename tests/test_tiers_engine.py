"""The host tier on the embedded engine (tiny model): blocks demoted to host RAM come back byte for
byte, generation from them equals cold generation, repeats still hit after demotion with a release
lag, salts isolate users, and the budgets hold against the tensors the engine really allocated."""

from __future__ import annotations

import random

import pytest
import torch

from ikcode.cache import hash_blocks
from ikcode.engines.base import EngineRequest, SamplingParams
from tests.tiny_model import assert_pool_clean, block_bytes, tiny_engine, wait_idle

BS = 16
BLOCK_BYTES = 2 * 2 * 2 * 16 * BS * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def run(engine, request_id: str, prompt: list[int], max_tokens: int = 4, **fields):
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens, final = engine.submit(EngineRequest(request_id, prompt, sampling, **fields)).collect(30)
    assert final.error is None, final.error
    wait_idle(engine)  # released: its blocks are committed
    return tokens, final.stats


def fill_device(engine, tag: str, rounds: int = 2, blocks: int | None = None) -> None:
    """Push earlier cached blocks off the device with prompts nobody asks for again."""
    n = (blocks or engine.num_blocks - 2) * BS
    for i in range(rounds):
        run(engine, f"fill-{tag}-{i}", prompt_of(hash((tag, i)) % 10_000, n), max_tokens=1, cache_salt=tag)


def host_engine(**config):
    defaults = dict(kv_memory_bytes=32 * BLOCK_BYTES, host_kv_memory_bytes=128 * BLOCK_BYTES)
    defaults.update(config)
    return tiny_engine(**defaults)


@pytest.mark.parametrize("architecture, write_through", [("llama", False), ("qwen2", False), ("llama", True)])
def test_promoted_blocks_are_byte_identical_and_generate_like_cold(architecture: str, write_through: bool):
    engine = host_engine(architecture=architecture, host_write_through=write_through)
    prefix, tail = prompt_of(1, 200), prompt_of(2, 40)
    run(engine, "turn1", prefix)
    keys = hash_blocks(prefix, BS)
    if write_through:  # on the host already, before any eviction
        assert engine.lookup(prefix).device_tokens == 192 and all(k in engine.cache.host.index for k in keys)
    before = {k: block_bytes(engine, engine.cache.pool.index[k]) for k in keys}

    fill_device(engine, "other")
    assert engine.lookup(prefix).host_tokens == len(keys) * BS  # all demoted, none on the device
    assert not any(k in engine.cache.pool.index for k in keys)

    tokens, stats = run(engine, "turn2", prefix + tail, max_tokens=12)
    assert (stats.cached_tokens_device, stats.cached_tokens_host) == (0, len(keys) * BS)
    for k in keys:
        assert block_bytes(engine, engine.cache.pool.index[k]) == before[k], "promoted KV differs"
    assert engine.cache.stats.promoted_blocks >= len(keys)
    assert_pool_clean(engine)
    engine.shutdown()

    cold = tiny_engine(architecture=architecture, kv_memory_bytes=32 * BLOCK_BYTES)
    cold_tokens, cold_stats = run(cold, "cold", prefix + tail, max_tokens=12)
    assert cold_stats.cached_tokens == 0
    assert tokens == cold_tokens
    cold.shutdown()


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_release_lag_repeat_hits_after_demotion_to_host(lag: int):
    engine = host_engine(release_lag_steps=lag)
    prompt = prompt_of(20 + lag, 400)
    run(engine, "first", prompt)
    fill_device(engine, "other")
    look = engine.lookup(prompt + [5, 6, 7])  # the request that follows
    assert (look.device_tokens, look.host_tokens) == (0, 400)
    _, stats = run(engine, "again", prompt + [5, 6, 7])
    assert stats.cached_tokens / stats.prompt_tokens >= 0.95
    assert stats.cached_tokens_host == 400
    assert_pool_clean(engine)
    engine.shutdown()


def test_salts_never_hit_across_users_in_either_tier():
    engine = host_engine()
    prompt = prompt_of(3, 300)
    run(engine, "alice-1", prompt, cache_salt="alice")
    assert engine.lookup(prompt, cache_salt="bob").cached_tokens == 0
    assert engine.lookup(prompt).cached_tokens == 0  # nor the shared namespace
    _, bob = run(engine, "bob-1", prompt, cache_salt="bob")
    assert bob.cached_tokens == 0

    fill_device(engine, "other")
    assert engine.lookup(prompt, cache_salt="alice").host_tokens == 288
    _, carol = run(engine, "carol-1", prompt + [9] * 20, cache_salt="carol")
    assert carol.cached_tokens == 0
    _, alice = run(engine, "alice-2", prompt + [9] * 20, cache_salt="alice")
    assert alice.cached_tokens_host + alice.cached_tokens_device == 288
    assert_pool_clean(engine)
    engine.shutdown()


def random_workload(engine, seed: int, num_requests: int, abort_fraction: float, probe=None) -> None:
    """Requests over a few shared roots (so prefixes hit, get demoted and promoted), some aborted
    at random moments: queued, mid-prefill, mid-decode."""
    rng = random.Random(seed)
    roots = [prompt_of(seed * 10 + i, rng.randrange(60, 200)) for i in range(3)]
    streams = []
    for i in range(num_requests):
        tail = prompt_of(rng.randrange(10**6), rng.randrange(1, 120))
        prompt = rng.choice(roots)[: rng.randrange(20, 200)] + tail
        sampling = SamplingParams(max_tokens=rng.randrange(1, 10), ignore_eos=True)
        stream = engine.submit(EngineRequest(f"r{i}", prompt, sampling, cache_salt=rng.choice(["", "u1"])))
        streams.append(stream)
        if rng.random() < abort_fraction:
            rng.choice(streams).abort()
        if probe is not None:
            probe()
        if rng.random() < 0.3:
            streams.pop().collect(30)  # let the queue drain a little now and then
    for stream in streams:
        stream.collect(30)
    wait_idle(engine)


@pytest.mark.parametrize("policy", ["lru", "ikcode"])
def test_no_leaks_after_aborts_with_demotions_and_promotions(policy: str):
    engine = host_engine(
        kv_memory_bytes=24 * BLOCK_BYTES, host_kv_memory_bytes=40 * BLOCK_BYTES, cache_policy=policy
    )
    random_workload(engine, seed=7, num_requests=40, abort_fraction=0.35)
    stats = engine.cache.stats
    assert stats.demoted_blocks > 0 and stats.promoted_blocks > 0 and stats.host_evicted_blocks > 0
    assert_pool_clean(engine)  # device pool back to its start: every block free or evictable
    host = engine.cache.host
    assert not host.pinned
    assert len(host.index) + len(host.free) == host.num_slots == 40

    # What the host tier still holds is still right: a hit on it generates like a cold run.
    key_slot = next(iter(host.index.items()), None)
    assert key_slot is not None
    prefix = prompt_of(99, 100)
    run(engine, "p1", prefix)
    fill_device(engine, "after")
    tokens, s = run(engine, "p2", prefix + [7] * 30, max_tokens=6)
    assert s.cached_tokens_host == 96
    engine.shutdown()
    cold = tiny_engine(kv_memory_bytes=24 * BLOCK_BYTES)
    assert run(cold, "cold", prefix + [7] * 30, max_tokens=6)[0] == tokens
    cold.shutdown()


def test_tier_budgets_hold_against_the_real_tensors():
    # Budgets that are not whole multiples of a block: the tiers must round down, never up.
    device_budget, host_budget = 20 * BLOCK_BYTES + 1000, 30 * BLOCK_BYTES + 5000
    engine = tiny_engine(kv_memory_bytes=device_budget, host_kv_memory_bytes=host_budget)
    runner = engine.runner
    device_bytes, host_bytes = runner.device_kv_bytes, runner.host_kv_bytes
    assert device_bytes <= device_budget and host_bytes <= host_budget
    assert device_bytes == engine.num_blocks * BLOCK_BYTES and engine.num_blocks == 20
    host_slot_bytes = host_bytes // engine.cache.num_host_blocks  # measured, from the tensors
    assert host_slot_bytes == BLOCK_BYTES and engine.cache.num_host_blocks == 30
    assert runner.host_pinned is (torch.cuda.is_available() and engine.device.type == "cuda")
    pointers = [t.data_ptr() for t in (runner.k_pool, runner.v_pool, runner.host.k, runner.host.v)]
    peaks = {"device": 0, "host": 0}

    def probe() -> None:
        with engine._lock:
            pool = engine.cache.pool  # blocks holding KV: referenced, or cached and evictable
            used_device = sum(1 for rc in pool.refcount if rc) + len(pool.policy)
            used_host = len(engine.cache.host.index)
        peaks["device"] = max(peaks["device"], used_device)
        peaks["host"] = max(peaks["host"], used_host)
        assert used_device * BLOCK_BYTES <= device_budget
        assert used_host * host_slot_bytes <= host_budget
        assert engine.cache.snapshot()["prefix_cache_host_bytes_used"] <= host_budget

    for seed in (1, 2, 3):
        random_workload(engine, seed=seed, num_requests=25, abort_fraction=0.2, probe=probe)
        probe()
    assert peaks["host"] == 30  # the workload did fill the host tier
    # Nothing grew or moved behind the budget's back.
    assert [t.data_ptr() for t in (runner.k_pool, runner.v_pool, runner.host.k, runner.host.v)] == pointers
    assert (runner.device_kv_bytes, runner.host_kv_bytes) == (device_bytes, host_bytes)
    assert_pool_clean(engine)
    engine.shutdown()
