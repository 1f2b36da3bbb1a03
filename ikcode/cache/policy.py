"""Eviction policy: which unreferenced cached device block goes first.

The policy only orders the *evictable* blocks (cached, refcount 0); the block pool owns
refcounts and the hash index. A sequence's blocks are handed over tail first, so within one
sequence the tail is evicted before the head (vLLM puts freed blocks into its free queue in
reverse order for the same reason: a head shared by many prompts outlives any one tail).

`LRUPolicy` is the plain baseline every other policy is measured against.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol, runtime_checkable


@runtime_checkable
class EvictionPolicy(Protocol):
    name: str

    def bind(self, num_device_blocks: int) -> None:
        """Told once the device capacity (policies may size their segments from it)."""

    def on_commit(self, block: int, sharer: str) -> None:
        """block was just indexed with a new key by `sharer` (a session or sequence id)."""

    def on_hit(self, block: int, sharer: str) -> None:
        """A lookup by `sharer` hit this cached block."""

    def push(
        self, blocks: list[int], now: float, hold_until: float | None, sharer: str = "", step: bool = True
    ) -> None:
        """blocks of one sequence of `sharer` became evictable, in eviction order (tail first).

        step: the release ended one of the sharer's steps (False for a preemption or an abort)."""

    def remove(self, block: int) -> None:
        """block is referenced again (a hit pinned it): no longer evictable."""

    def pop_victim(self, now: float) -> int | None:
        """Remove and return the block to evict next, None when nothing is evictable."""

    def forget(self, block: int) -> None:
        """block left the index (evicted): drop any metadata kept about it."""

    def __len__(self) -> int: ...

    def __contains__(self, block: object) -> bool: ...

    def __iter__(self) -> Iterator[int]: ...


class LRUPolicy:
    """Least recently released first; tail-first within a sequence."""

    name = "lru"

    def __init__(self) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict()  # front = next victim

    def bind(self, num_device_blocks: int) -> None:
        pass

    def on_commit(self, block: int, sharer: str) -> None:
        pass

    def on_hit(self, block: int, sharer: str) -> None:
        pass

    def push(
        self, blocks: list[int], now: float, hold_until: float | None, sharer: str = "", step: bool = True
    ) -> None:
        for b in blocks:
            self._queue[b] = None

    def remove(self, block: int) -> None:
        del self._queue[block]

    def pop_victim(self, now: float) -> int | None:
        return self._queue.popitem(last=False)[0] if self._queue else None

    def forget(self, block: int) -> None:
        pass

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block: object) -> bool:
        return block in self._queue

    def __iter__(self) -> Iterator[int]:
        return iter(self._queue)


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    if not isinstance(policy, str):
        return policy
    if policy == "lru":
        return LRUPolicy()
    if policy == "ikcode":
        from ikcode.cache.ikcode_policy import IkcodePolicy

        return IkcodePolicy()
    raise ValueError(f"unknown cache policy {policy!r} (known: lru, ikcode)")
