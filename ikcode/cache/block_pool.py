"""The device block pool: refcounts, the key -> block index, free blocks, evictable blocks.

Every device block is in exactly one state:
  referenced  refcount > 0 (some running sequence uses it; never evicted)
  evictable   refcount 0, holds a committed key, ordered by the eviction policy
  free        refcount 0, no key (never written, or its KV was never committed)
Uncached free blocks are handed out before any cached block is evicted.
"""

from __future__ import annotations

from .hashing import BlockHash
from .policy import EvictionPolicy


class BlockPool:
    def __init__(self, num_blocks: int, policy: EvictionPolicy):
        if num_blocks <= 0:
            raise ValueError(f"num_device_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.policy = policy
        self.refcount = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.index: dict[BlockHash, int] = {}
        # LIFO stack of uncached free blocks; reversed so block 0 is handed out first.
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        policy.bind(num_blocks)

    def lookup(self, key: BlockHash) -> int | None:
        return self.index.get(key)

    def num_available(self) -> int:
        """Blocks that can be handed out now: free + evictable."""
        return len(self.free) + len(self.policy)

    def pin(self, block: int) -> None:
        if self.refcount[block] == 0:
            self.policy.remove(block)
        self.refcount[block] += 1

    def take(self, now: float) -> tuple[int, BlockHash | None]:
        """A block for new KV, referenced once. Returns (block, key it held if it was evicted)."""
        if self.free:
            block = self.free.pop()
            evicted = None
        else:
            victim = self.policy.pop_victim(now)
            if victim is None:
                raise RuntimeError("take() called with no free or evictable block")
            block = victim
            evicted = self.block_hash[block]
            assert evicted is not None
            del self.index[evicted]
            self.block_hash[block] = None
            self.policy.forget(block)
        self.refcount[block] = 1
        return block, evicted

    def commit(self, block: int, key: BlockHash, sharer: str) -> bool:
        """Index a referenced block under key. False if key already lives elsewhere (keep that one)."""
        current = self.block_hash[block]
        if current is not None:
            return current == key
        if key in self.index:
            return False
        self.block_hash[block] = key
        self.index[key] = block
        self.policy.on_commit(block, sharer)
        return True

    def unref(
        self, table: list[int], now: float, hold_until: float | None, sharer: str = "", step: bool = True
    ) -> None:
        """Drop one reference from each block of a sequence's table; tail first."""
        evictable: list[int] = []
        for block in reversed(table):
            rc = self.refcount[block] - 1
            assert rc >= 0, f"block {block} refcount would go negative"
            self.refcount[block] = rc
            if rc == 0:
                if self.block_hash[block] is None:
                    self.free.append(block)
                else:
                    evictable.append(block)
        if evictable:
            self.policy.push(evictable, now, hold_until, sharer, step=step)

    def check(self) -> None:
        free = set(self.free)
        assert len(free) == len(self.free), "a block is in the free list twice"
        evictable = set(self.policy)
        assert len(evictable) == len(self.policy), "a block is evictable twice"
        referenced = {b for b in range(self.num_blocks) if self.refcount[b] > 0}
        assert all(rc >= 0 for rc in self.refcount), "negative refcount"
        assert not (free & evictable) and not (free & referenced) and not (evictable & referenced)
        assert len(free) + len(evictable) + len(referenced) == self.num_blocks, "blocks leaked"
        for b in free:
            assert self.block_hash[b] is None, f"free block {b} still holds a key"
        for b in evictable:
            assert self.block_hash[b] is not None, f"evictable block {b} holds no key"
        assert len(self.index) == sum(h is not None for h in self.block_hash)
        for key, b in self.index.items():
            assert self.block_hash[b] == key, f"index maps a key to block {b} holding another key"
