import pytest

from ikcode.cache import OutOfBlocks, PrefixCache, hash_blocks
from tests.test_cache_helpers import ByteStore, check_bytes, compute

BS = 4


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_commit_happens_on_release_not_before():
    c = PrefixCache(16, BS)
    h = hash_blocks(toks(20), BS)
    c.allocate("a", h, 5)
    # Still running (e.g. its final token came out but the engine has not released it): no entry.
    assert c.match(h).device_blocks == 0
    c.release("a", h)
    assert c.match(h).device_blocks == 5
    a = c.allocate("b", h + hash_blocks(toks(8, 20), BS, parent=h[-1]), 7, num_tokens=28)
    assert a.cached_blocks_device == 5 and a.block_table[:5] == list(range(5))
    assert c.stats.hit_tokens_device == 20 and c.stats.query_tokens == 20 + 28
    c.release("b", [])
    c.check_invariants()


def test_release_without_commit_frees_everything():
    c = PrefixCache(8, BS)
    h = hash_blocks(toks(32), BS)
    c.allocate("a", h, 8)
    assert c.num_free_blocks() == 0
    c.release("a", [])
    assert c.num_free_blocks() == 8 and c.num_cached_blocks == 0
    c.check_invariants()


def test_referenced_blocks_are_never_evicted_and_out_of_blocks_changes_nothing():
    c = PrefixCache(6, BS)
    h = hash_blocks(toks(16), BS)
    c.allocate("a", h, 4)
    c.release("a", h)
    c.allocate("b", h[:2], 3)  # pins 2 cached blocks, takes 1 fresh
    before = (c.num_free_blocks(), c.num_cached_blocks, c.stats.requests)
    with pytest.raises(OutOfBlocks):
        c.allocate("c", hash_blocks(toks(16, 1000), BS), 4)
    assert (c.num_free_blocks(), c.num_cached_blocks, c.stats.requests) == before
    c.check_invariants()
    assert c.match(h).device_blocks >= 2


def test_eviction_is_lru_and_tail_first():
    c = PrefixCache(4, BS)
    h1 = hash_blocks(toks(8, 0), BS)
    h2 = hash_blocks(toks(8, 100), BS)
    for name, h in (("a", h1), ("b", h2)):
        c.allocate(name, h, 2)
        c.release(name, h)
    c.allocate("c", hash_blocks(toks(4, 500), BS), 1)  # one eviction: a's tail goes first
    assert c.match(h1).device_blocks == 1 and c.match(h2).device_blocks == 2
    c.release("c", [])
    c.allocate("d", hash_blocks(toks(8, 600), BS), 2)  # uses the freed block, then a's head
    assert c.match(h1).device_blocks == 0 and c.match(h2).device_blocks == 2
    c.check_invariants()


def test_duplicate_commit_keeps_existing_block():
    c = PrefixCache(8, BS)
    h = hash_blocks(toks(8), BS)
    c.allocate("a", h, 2)
    c.allocate("b", h, 2)  # both miss: run concurrently, same prompt
    c.release("a", h)
    c.release("b", h)
    assert c.num_cached_blocks == 2 and c.num_free_blocks() == 8
    c.check_invariants()


def test_append_block_and_out_of_blocks():
    c = PrefixCache(3, BS)
    c.allocate("a", [], 2)
    c.append_block("a")
    with pytest.raises(OutOfBlocks):
        c.append_block("a")
    c.release("a", [])
    c.check_invariants()


def test_demote_then_promote_returns_the_same_bytes():
    store = ByteStore(4, 8)
    c = PrefixCache(4, BS, num_host_blocks=8, store=store, bytes_per_block=100)
    h1 = hash_blocks(toks(16, 0), BS)
    a = c.allocate("a", h1, 4)
    compute(store, a, h1, "a")
    c.release("a", h1)
    h2 = hash_blocks(toks(16, 900), BS)
    b = c.allocate("b", h2, 4)  # evicts all of a's blocks to host
    compute(store, b, h2, "b")
    c.release("b", h2)
    check_bytes(c, store)
    assert c.match(h1).host_blocks == 4 and c.stats.demoted_blocks == 4
    a2 = c.allocate("a2", h1, 4)
    assert (a2.cached_blocks_device, a2.cached_blocks_host) == (0, 4)
    compute(store, a2, h1, "a2")  # asserts the promoted KV is what was demoted
    assert c.stats.hit_tokens_host == 16 and c.stats.promoted_bytes == 400
    c.release("a2", h1)
    check_bytes(c, store)
    c.check_invariants()


def test_write_through_makes_eviction_free():
    store = ByteStore(4, 8)
    c = PrefixCache(4, BS, num_host_blocks=8, store=store, write_through=True)
    h1 = hash_blocks(toks(16), BS)
    compute(store, c.allocate("a", h1, 4), h1, "a")
    c.release("a", h1)
    assert store.copies_to_host == 4
    h2 = hash_blocks(toks(16, 900), BS)
    compute(store, c.allocate("b", h2, 4), h2, "b")
    assert store.copies_to_host == 4  # a's blocks were already on the host
    c.release("b", h2)
    check_bytes(c, store)
    assert c.match(h1).host_blocks == 4
    c.check_invariants()


def test_regret_counts_evicted_then_requested():
    now = [0.0]
    c = PrefixCache(2, BS, clock=lambda: now[0])
    h1 = hash_blocks(toks(8), BS)
    c.allocate("a", h1, 2)
    c.release("a", h1)
    now[0] = 5.0
    h2 = hash_blocks(toks(8, 50), BS)
    c.allocate("b", h2, 2)
    c.release("b", h2)
    now[0] = 35.0
    c.allocate("c", h1, 2)
    assert c.stats.regret_blocks == 2 and c.stats.regret_seconds_sum == pytest.approx(60.0)
    d = c.stats.to_dict()
    assert d["prefix_cache_regret_seconds_bucket{le=60}"] == 2
    assert d["prefix_cache_regret_seconds_bucket{le=10}"] == 0


class _RecordingStore:
    """Copies recorded, or refused (a failed device-to-host copy)."""

    def __init__(self, fail: bool = False):
        self.fail, self.to_host = fail, []

    def copy_device_to_host(self, pairs):
        if self.fail:
            raise RuntimeError("device-to-host copy failed")
        self.to_host.append(list(pairs))

    def copy_host_to_device(self, pairs):
        pass


def test_write_through_does_not_copy_a_key_the_host_already_holds():
    """An exact repeat of a block-aligned prompt recomputes its last block (the last token always
    runs): its key was written to the host already, and was copied and counted again."""
    store = _RecordingStore()
    cache = PrefixCache(2, 4, 8, store=store, write_through=True)
    keys = hash_blocks(list(range(8)), 4)
    for seq in ("a", "b"):
        cache.allocate(seq, keys, 2, num_tokens=8)
        cache.release(seq, keys)
    assert [len(pairs) for pairs in store.to_host] == [2]
    assert cache.stats.demoted_blocks == 2
    cache.check_invariants()


def test_a_failed_write_through_drops_nothing_still_on_the_device():
    """The host copies never landed, but the keys were just committed to the device: they are
    not dropped (no ghost entry, no on_dropped call), as for a host eviction."""
    dropped: list = []
    store = _RecordingStore(fail=True)
    cache = PrefixCache(4, 1, 4, store=store, write_through=True, on_dropped=dropped.append)
    cache.allocate("s", [b"k1", b"k2"], 2)
    with pytest.raises(RuntimeError):
        cache.release("s", [b"k1", b"k2"])
    assert all(key in cache.pool.index for key in (b"k1", b"k2"))
    assert not any(key in cache.host.index for key in (b"k1", b"k2"))
    assert (cache.stats.dropped_blocks, dropped, len(cache.ghost)) == (0, [], 0)
    cache.check_invariants()
