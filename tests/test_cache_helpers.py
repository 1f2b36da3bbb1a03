"""A stand-in engine for cache tests: it 'computes' KV as the block's key and moves it on copies,
so a hit whose bytes are wrong (bad copy order, overwritten slot) shows up as a wrong key."""

from __future__ import annotations

from ikcode.cache import Allocation, PrefixCache


class ByteStore:
    def __init__(self, num_device_blocks: int, num_host_blocks: int):
        self.device: list[object] = [None] * num_device_blocks
        self.host: list[object] = [None] * num_host_blocks
        self.copies_to_host = 0
        self.copies_to_device = 0

    def copy_device_to_host(self, pairs: list[tuple[int, int]]) -> None:
        for d, h in pairs:
            self.host[h] = self.device[d]
        self.copies_to_host += len(pairs)

    def copy_host_to_device(self, pairs: list[tuple[int, int]]) -> None:
        for h, d in pairs:
            self.device[d] = self.host[h]
        self.copies_to_device += len(pairs)


def compute(store: ByteStore, alloc: Allocation, hashes: list, tag: object) -> None:
    """Check the cached part holds the right KV, then write the rest (as the engine would)."""
    for i in range(alloc.cached_blocks):
        assert store.device[alloc.block_table[i]] == hashes[i], f"cached block {i} holds wrong KV"
    for i in range(alloc.cached_blocks, len(alloc.block_table)):
        store.device[alloc.block_table[i]] = hashes[i] if i < len(hashes) else ("partial", tag, i)


def check_bytes(cache: PrefixCache, store: ByteStore) -> None:
    for key, block in cache.pool.index.items():
        assert store.device[block] == key, "an indexed device block holds other KV"
    for key, slot in cache.host.index.items():
        assert store.host[slot] == key, "an indexed host slot holds other KV"
