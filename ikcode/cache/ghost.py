"""A bounded memory of keys that left the cache, to measure regret.

When a lookup asks for a key the cache no longer holds, and that key is here, the eviction was
a regret: the policy threw away something that came back. Recording the time since eviction
tells how long a tier would have had to hold it (facts: median reuse gap ~1 minute).
"""

from __future__ import annotations

from collections import OrderedDict

from .hashing import BlockHash


class GhostList:
    def __init__(self, capacity: int):
        self.capacity = max(0, capacity)
        self._evicted_at: OrderedDict[BlockHash, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._evicted_at)

    def add(self, key: BlockHash, now: float) -> None:
        if self.capacity == 0:
            return
        self._evicted_at[key] = now
        self._evicted_at.move_to_end(key)
        while len(self._evicted_at) > self.capacity:
            self._evicted_at.popitem(last=False)

    def pop(self, key: BlockHash) -> float | None:
        """Eviction time of key if it is remembered (and forget it: it is back in the cache)."""
        return self._evicted_at.pop(key, None)

    def discard(self, key: BlockHash) -> None:
        self._evicted_at.pop(key, None)
