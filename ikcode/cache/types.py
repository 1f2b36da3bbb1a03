"""The small value types of the cache API, shared by the cache and the engines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class OutOfBlocks(Exception):
    """Not enough free or evictable device blocks; the cache did not change."""

    def __init__(self, needed: int, available: int):
        self.needed = needed
        self.available = available
        super().__init__(f"out of KV blocks: need {needed}, {available} free or evictable")


class KVStore(Protocol):
    """Implemented by an engine with a host tier: it moves the bytes, the cache decides which."""

    def copy_device_to_host(self, pairs: list[tuple[int, int]]) -> None: ...  # (device_block, host_slot)

    def copy_host_to_device(self, pairs: list[tuple[int, int]]) -> None: ...  # (host_slot, device_block)


@dataclass(frozen=True)
class Match:
    """Result of a side-effect-free lookup: a contiguous cached prefix, split by tier."""

    device_blocks: int  # leading blocks found in device memory
    host_blocks: int  # blocks right after those, found in the host tier

    @property
    def blocks(self) -> int:
        return self.device_blocks + self.host_blocks


@dataclass
class Allocation:
    block_table: list[int]  # device block ids for the whole prompt, in order
    cached_blocks_device: int  # leading blocks whose KV is already valid (device hit)
    cached_blocks_host: int  # next blocks whose KV was copied back from host (now valid)

    @property
    def cached_blocks(self) -> int:
        return self.cached_blocks_device + self.cached_blocks_host
