"""The cache's own invariants under failure and sharing: copy then commit (a failed tier copy is
rolled back), no write into a shared committed block, and only real replies count as steps."""

from __future__ import annotations

import random
import threading

import pytest

from ikcode.cache import OutOfBlocks, PrefixCache, hash_blocks
from ikcode.cache.ikcode_policy import IkcodePolicy
from ikcode.engines.base import EngineRequest, LifecycleKind, SamplingParams
from tests.test_cache_helpers import ByteStore, check_bytes, compute
from tests.tiny_model import assert_pool_clean, tiny_engine, wait_idle

BS = 4


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


class CopyFailed(RuntimeError):
    pass


class FlakyStore(ByteStore):
    """A ByteStore whose next copies fail (a device error, an out-of-memory in the host tier).
    It also records, at each promotion, whether the cache had already indexed the target."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int):
        super().__init__(num_device_blocks, num_host_blocks)
        self.fail_to_host = False
        self.fail_to_device = False
        self.cache: PrefixCache | None = None
        self.indexed_before_copy: list[int] = []

    def copy_device_to_host(self, pairs: list[tuple[int, int]]) -> None:
        if self.fail_to_host:
            raise CopyFailed("device -> host copy failed")
        super().copy_device_to_host(pairs)

    def copy_host_to_device(self, pairs: list[tuple[int, int]]) -> None:
        assert self.cache is not None
        self.indexed_before_copy += [d for _, d in pairs if self.cache.pool.block_hash[d] is not None]
        if self.fail_to_device:
            raise CopyFailed("host -> device copy failed")
        super().copy_host_to_device(pairs)


def tiered(num_device: int = 4, num_host: int = 8) -> tuple[PrefixCache, FlakyStore]:
    store = FlakyStore(num_device, num_host)
    cache = PrefixCache(num_device, BS, num_host, store=store)
    store.cache = cache
    return cache, store


def run(cache: PrefixCache, store: ByteStore, seq: str, hashes: list, n: int | None = None) -> None:
    n = len(hashes) if n is None else n
    alloc = cache.allocate(seq, hashes, n)
    compute(store, alloc, hashes, seq)
    cache.release(seq, hashes)


def demoted_prompt(cache: PrefixCache, store: FlakyStore) -> list:
    """A 4-block prompt that has been pushed out to the host tier by another one."""
    a = hash_blocks(toks(16), BS)
    run(cache, store, "a", a)
    run(cache, store, "b", hash_blocks(toks(16, 100), BS))  # evicts a's blocks to the host
    assert cache.match(a).host_blocks == 4
    return a


def test_promoted_block_is_indexed_only_after_its_copy():
    cache, store = tiered()
    a = demoted_prompt(cache, store)
    alloc = cache.allocate("again", a, 4)
    assert alloc.cached_blocks_host == 4
    assert store.indexed_before_copy == [], "a promoted block was indexed before its bytes arrived"
    compute(store, alloc, a, "again")
    cache.release("again", a)
    check_bytes(cache, store)
    cache.check_invariants()


def test_failed_promotion_copy_rolls_the_allocation_back():
    cache, store = tiered()
    a = demoted_prompt(cache, store)
    store.fail_to_device = True
    with pytest.raises(CopyFailed):
        cache.allocate("again", a, 4)
    cache.check_invariants()  # no block owned by nobody, no host slot left pinned
    check_bytes(cache, store)  # no index entry points at bytes that never arrived
    assert cache.num_free_blocks() == 4
    store.fail_to_device = False
    alloc = cache.allocate("again", a, 4)  # the cache still works and still has a's KV
    assert alloc.cached_blocks == 4
    compute(store, alloc, a, "again")
    cache.release("again", a)
    check_bytes(cache, store)
    cache.check_invariants()


def test_failed_demotion_copy_rolls_the_allocation_back():
    cache, store = tiered()
    a = hash_blocks(toks(16), BS)
    run(cache, store, "a", a)
    store.fail_to_host = True
    b = hash_blocks(toks(16, 100), BS)
    with pytest.raises(CopyFailed):
        cache.allocate("b", b, 4)  # must evict a's blocks; their copy to the host fails
    cache.check_invariants()
    check_bytes(cache, store)  # the host tier does not claim a's blocks
    store.fail_to_host = False
    run(cache, store, "b", b)
    check_bytes(cache, store)
    cache.check_invariants()


def test_failed_write_through_copy_still_releases_the_sequence():
    store = FlakyStore(4, 8)
    cache = PrefixCache(4, BS, 8, store=store, write_through=True)
    store.cache = cache
    a = hash_blocks(toks(16), BS)
    alloc = cache.allocate("a", a, 4)
    compute(store, alloc, a, "a")
    store.fail_to_host = True
    with pytest.raises(CopyFailed):
        cache.release("a", a)
    cache.check_invariants()  # no references leaked by the failed release
    check_bytes(cache, store)
    assert cache.num_free_blocks() == 4


class RecordingStore(FlakyStore):
    def __init__(self, num_device_blocks: int, num_host_blocks: int):
        super().__init__(num_device_blocks, num_host_blocks)
        self.to_host: list[list[tuple[int, int]]] = []

    def copy_device_to_host(self, pairs: list[tuple[int, int]]) -> None:
        self.to_host.append(list(pairs))
        super().copy_device_to_host(pairs)


@pytest.mark.parametrize("fails", [False, True])
def test_one_allocation_never_demotes_two_blocks_into_one_host_slot(fails):
    """Two evictions in one allocation, one host slot: the second must not take the slot the
    first was given before its copy ran (two copies into one slot; on failure, a roll-back that
    dropped the slot twice and left the allocation's blocks referenced)."""
    store = RecordingStore(2, 1)
    cache = PrefixCache(2, BS, 1, store=store)
    store.cache = cache
    run(cache, store, "a", hash_blocks(toks(8), BS))
    store.fail_to_host = fails
    b = hash_blocks(toks(8, 100), BS)
    if fails:
        with pytest.raises(CopyFailed):
            cache.allocate("b", b, 2)
    else:
        run(cache, store, "b", b)
        slots = [slot for _, slot in store.to_host[-1]]
        assert len(slots) == len(set(slots)) == 1  # one demoted, the other dropped
    cache.check_invariants()
    check_bytes(cache, store)
    assert cache.num_free_blocks() == 2


def test_the_host_run_of_a_hit_stops_at_a_key_the_device_holds():
    """Both tiers may hold a key (promoted, or written through). A prompt whose first block is on
    the host only and whose second is on the device too: the hit is the first block alone (the
    second promoted into a fresh block could not be indexed: an assertion in allocate)."""
    store = FlakyStore(8, 8)
    cache = PrefixCache(8, BS, 8, store=store, write_through=True)
    store.cache = cache
    a = hash_blocks(toks(12), BS)
    run(cache, store, "a", a)  # 3 blocks on the device, and written through to the host
    pool = cache.pool  # the first block alone leaves the device, as an eviction does it
    evicted = pool.index.pop(a[0])
    pool.block_hash[evicted] = None
    pool.policy.remove(evicted)
    pool.policy.forget(evicted)
    pool.free.append(evicted)
    cache.check_invariants()
    assert a[0] not in cache.pool.index and a[1] in cache.pool.index and a[0] in cache.host.index
    assert cache.match(a) == cache.match(a[:1])  # device 0, host 1
    run(cache, store, "again", a)
    cache.check_invariants()
    check_bytes(cache, store)


# ---- no write into a shared block ------------------------------------------------------------
def test_full_hit_on_a_block_aligned_prompt_leaves_the_last_block_fresh():
    cache = PrefixCache(16, BS)
    prompt = hash_blocks(toks(16), BS)  # 16 tokens: exactly 4 full blocks
    cache.allocate("first", prompt, 4, num_tokens=16)
    cache.release("first", prompt)
    shared = cache.allocate("reader", prompt, 4, num_tokens=16)  # still running: reads its blocks
    again = cache.allocate("again", prompt, 4, num_tokens=16)
    # The last prompt token is recomputed and its K/V row written: into a block of its own.
    assert again.cached_blocks_device == 3 == (16 - 1) // BS
    last = again.block_table[-1]
    assert cache.pool.block_hash[last] is None and cache.pool.refcount[last] == 1
    assert last not in shared.block_table
    # One token past the boundary: all four full blocks are reusable.
    longer = hash_blocks(toks(17), BS)
    past = cache.allocate("past", longer, 5, num_tokens=17)
    assert past.cached_blocks_device == 4
    for seq in ("reader", "again", "past"):
        cache.release(seq, [])
    cache.check_invariants()


# ---- only real replies are session steps ------------------------------------------------------
def test_preemptions_and_aborts_are_not_session_steps():
    policy = IkcodePolicy()
    cache = PrefixCache(32, BS, policy=policy)
    for i in range(3):  # three preempted or aborted tries of the session's first step
        keys = hash_blocks(toks(8, 1000 * i), BS)
        cache.allocate(f"try{i}", keys, 2, session_id="s")
        cache.release(f"try{i}", keys, session_id="s", step=False)
    keys = hash_blocks(toks(8, 5000), BS)
    cache.allocate("reply", keys, 2, session_id="s")
    cache.release("reply", keys, session_id="s")  # the first reply: a first step, not returning
    block = cache.pool.index[keys[0]]
    assert block in policy._probation, "a preemption or an abort was counted as a session step"
    keys = hash_blocks(toks(8, 6000), BS)
    cache.allocate("reply2", keys, 2, session_id="s")
    cache.release("reply2", keys, session_id="s")  # the second reply: a returning session
    assert cache.pool.index[keys[0]] in policy._protected
    cache.check_invariants()


# ---- the same rules through the real engine ---------------------------------------------------
def _engine_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def test_engine_never_writes_into_a_committed_block():
    """Every K/V row the model writes lands in a block that no cache index entry points at."""
    engine = tiny_engine(kv_memory_bytes=1 << 20)
    bs = engine.config.block_size
    writes_into_committed: list[tuple[str, int]] = []
    run_batch = engine.runner.run

    def checked_run(scheduled):
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            for position in range(start, start + item.num_tokens):
                block = seq.block_table[position // bs]
                if engine.cache.pool.block_hash[block] is not None:
                    writes_into_committed.append((seq.seq_id, block))
        return run_batch(scheduled)

    engine.runner.run = checked_run
    prompt = _engine_prompt(7, 4 * bs)  # block-aligned: a repeat is a full hit
    for name in ("first", "again", "third"):
        engine.submit(EngineRequest(name, prompt, SamplingParams(max_tokens=2))).collect(30)
        wait_idle(engine)
    assert writes_into_committed == [], writes_into_committed
    assert_pool_clean(engine)
    engine.shutdown()


def test_admitted_listener_may_call_back_into_the_engine():
    """Lifecycle events leave the engine outside its lock: a listener that asks for load() does
    not deadlock the engine thread."""
    engine = tiny_engine(kv_memory_bytes=1 << 20)
    stuck: list[str] = []

    def listener(event) -> None:
        if event.kind is not LifecycleKind.ADMITTED:
            return
        probe = threading.Thread(target=engine.load, daemon=True)
        probe.start()
        probe.join(2.0)  # load() waits for the engine lock: held by our caller, it never comes
        if probe.is_alive():
            stuck.append(event.request_id)

    engine.add_listener(listener)
    engine.submit(EngineRequest("r", _engine_prompt(3, 40), SamplingParams(max_tokens=2))).collect(30)
    assert stuck == [], "ADMITTED was emitted while the engine lock was held"
    assert_pool_clean(engine)
    engine.shutdown()


class RandomlyFailingStore(ByteStore):
    def __init__(self, num_device_blocks: int, num_host_blocks: int, rng: random.Random):
        super().__init__(num_device_blocks, num_host_blocks)
        self.rng = rng

    def copy_device_to_host(self, pairs: list[tuple[int, int]]) -> None:
        if self.rng.random() < 0.05:
            raise CopyFailed("device -> host")
        super().copy_device_to_host(pairs)

    def copy_host_to_device(self, pairs: list[tuple[int, int]]) -> None:
        if self.rng.random() < 0.05:
            raise CopyFailed("host -> device")
        super().copy_host_to_device(pairs)


@pytest.mark.parametrize("seed", range(40))
def test_random_operations_with_failing_copies_keep_every_invariant(seed):
    """Allocate (prompts sharing prefixes, under salts), grow and release at random on small tiers,
    with 5% of the tier copies failing: after every operation the invariants hold, every indexed
    block holds its key's bytes, and a running sequence's blocks are never overwritten."""
    rng = random.Random(seed)
    num_device, num_host = rng.randint(1, 12), rng.randint(0, 10)
    store = RandomlyFailingStore(num_device, num_host, rng)
    now = [0.0]
    cache = PrefixCache(
        num_device, 2, num_host, store=store, policy=rng.choice(["lru", "ikcode"]),
        write_through=rng.random() < 0.5, clock=lambda: now[0],
    )  # fmt: skip
    live: dict[str, list] = {}
    for op in range(300):
        now[0] += rng.choice([0.1, 1.0, 50.0])
        r = rng.random()
        if r < 0.45:
            tokens = [rng.randrange(3) + 3 * (i % 2) for i in range(rng.randrange(1, 15))]
            keys = hash_blocks(tokens, 2, rng.choice(["", "", "salt"]))
            blocks = -(-len(tokens) // 2) + rng.randrange(0, 2)
            try:
                alloc = cache.allocate(f"s{op}", keys, blocks, num_tokens=len(tokens))
            except (OutOfBlocks, CopyFailed):
                pass
            else:
                compute(store, alloc, keys, f"s{op}")
                live[f"s{op}"] = keys
        elif live and r < 0.6:
            seq = rng.choice(sorted(live))
            try:
                store.device[cache.append_block(seq)] = ("grown", seq)
            except (OutOfBlocks, CopyFailed):
                pass
        elif live:
            seq = rng.choice(sorted(live))
            keys = live.pop(seq)
            try:
                committed = rng.choice([keys, [], keys[: len(keys) // 2]])
                cache.release(seq, committed, hold_s=rng.choice([None, 100.0]))
            except CopyFailed:
                pass
        for seq, keys in live.items():
            table = cache.block_table(seq)
            assert all(store.device[table[i]] == k for i, k in enumerate(keys[: len(table)])), (seed, op)
        cache.check_invariants()
        check_bytes(cache, store)
    for seq in list(live):
        cache.release(seq, [])
    assert cache.num_free_blocks() == num_device


def test_a_key_still_on_the_device_is_not_dropped_when_the_host_lets_it_go():
    """With write-through every committed key is on both tiers; the host evicting one that the
    device still holds counted it as gone from every tier (dropped_blocks, the ghost list and
    on_dropped, which frees what goes with a key: DeepInfer's window snapshots)."""
    dropped: list = []
    cache = PrefixCache(2, 1, 1, write_through=True, on_dropped=dropped.append)
    for seq, key in (("s1", b"k1"), ("s2", b"k2")):
        cache.allocate(seq, [key], 1)
        cache.release(seq, [key])
    assert b"k1" in cache.pool.index and b"k1" not in cache.host.index  # the host let it go
    assert dropped == [] and cache.stats.dropped_blocks == 0
    cache.check_invariants()
