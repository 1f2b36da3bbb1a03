"""The host-RAM tier: a fixed number of slots holding demoted blocks, LRU among unpinned ones.

The cache decides which key goes to which slot; the engine copies the bytes (KVStore). Slots
being promoted in the current allocation are pinned so a demotion in the same call can never
overwrite them. The tier never holds more than num_slots keys: that is its whole budget.
"""

from __future__ import annotations

from collections import OrderedDict

from .hashing import BlockHash


class HostTier:
    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self.index: dict[BlockHash, int] = {}
        self.slot_hash: list[BlockHash | None] = [None] * num_slots
        self.lru: OrderedDict[int, None] = OrderedDict()  # used, unpinned slots; front = next victim
        self.pinned: set[int] = set()
        self.free: list[int] = list(range(num_slots - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.index)

    def lookup(self, key: BlockHash) -> int | None:
        return self.index.get(key)

    def touch(self, slot: int) -> None:
        if slot in self.lru:
            self.lru.move_to_end(slot)

    def pin(self, slot: int) -> None:
        self.lru.pop(slot, None)
        self.pinned.add(slot)

    def unpin(self, slot: int) -> None:
        self.pinned.discard(slot)
        self.lru[slot] = None  # most recently used: it was just read

    def put(self, key: BlockHash) -> tuple[int | None, BlockHash | None]:
        """A slot for key (already indexed: that slot). Returns (slot or None if every slot is
        pinned, the key evicted from the tier to make room or None)."""
        slot = self.index.get(key)
        if slot is not None:
            self.touch(slot)
            return slot, None
        evicted = None
        if self.free:
            slot = self.free.pop()
        elif self.lru:
            slot = self.lru.popitem(last=False)[0]
            evicted = self.slot_hash[slot]
            assert evicted is not None
            del self.index[evicted]
        else:
            return None, None
        self.slot_hash[slot] = key
        self.index[key] = slot
        self.lru[slot] = None
        return slot, evicted

    def drop(self, slot: int) -> BlockHash:
        """Forget what slot holds (its copy failed); returns the key it was given."""
        key = self.slot_hash[slot]
        assert key is not None, f"host slot {slot} holds nothing"
        del self.index[key]
        self.slot_hash[slot] = None
        self.lru.pop(slot, None)
        self.pinned.discard(slot)
        self.free.append(slot)
        return key

    def check(self) -> None:
        used = set(self.lru) | self.pinned
        assert not (set(self.lru) & self.pinned), "a host slot is both pinned and in the LRU"
        assert len(self.index) <= self.num_slots, "host tier over budget"
        assert len(used) == len(self.index), "host slot accounting disagrees with the index"
        assert len(used) + len(self.free) == self.num_slots, "host slots leaked"
        for key, slot in self.index.items():
            assert self.slot_hash[slot] == key
        for slot in self.free:
            assert self.slot_hash[slot] is None and slot not in used, f"free host slot {slot} in use"
