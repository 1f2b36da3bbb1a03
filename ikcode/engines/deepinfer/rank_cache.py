"""The prefix cache on one DeepInfer rank: ikcode's PrefixCache as index and policy, DeepInfer's
own KV blocks as the GPU tier (pinned), host RAM pages as the host tier.

A GPU-tier slot of the PrefixCache is bound to one engine block that the cache keeps pinned
(`pin_blocks`, pybind_scheduler.cpp:65-73) so that `free_seq` leaves it alone. A hit is copied
into the new sequence's own blocks (D2D from pinned blocks, H2D from host pages) together with
the sliding-window state snapshot taken at the same 128 boundary (cache_engine.py:762-848).
Everything here runs on the rank's engine thread, except `match` (under the rank's lock).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from ikcode.cache import BlockHash, OutOfBlocks, PrefixCache


class PageMover:
    """Copies 128-token KV pages between engine blocks and host pages, layer by layer. Works on
    the worker's per-layer cache tensors (torch on the GPU, numpy in the stand-in)."""

    def __init__(self, gpu_cache: list[Any], num_host_pages: int):
        self.gpu_cache = gpu_cache
        self.host = [_empty_like_pages(layer, num_host_pages) for layer in gpu_cache if num_host_pages]

    def device_to_device(self, src: int, dst: int) -> None:
        for layer in self.gpu_cache:
            layer[dst] = layer[src]

    def device_to_host(self, block: int, page: int) -> None:
        for layer, host in zip(self.gpu_cache, self.host, strict=True):
            host[page] = _to_host(layer[block])

    def host_to_device(self, page: int, block: int) -> None:
        for layer, host in zip(self.gpu_cache, self.host, strict=True):
            layer[block] = _to_device(host[page], layer)


def _empty_like_pages(layer: Any, n: int) -> Any:
    shape = (n, *tuple(layer.shape[1:]))
    if hasattr(layer, "new_empty"):  # torch: page-locked host memory for fast H2D/D2H
        import torch

        return torch.empty(shape, dtype=layer.dtype, pin_memory=layer.is_cuda)
    import numpy as np

    return np.empty(shape, dtype=layer.dtype)


def _to_host(page: Any) -> Any:
    return page.cpu() if hasattr(page, "cpu") else page


def _to_device(page: Any, layer: Any) -> Any:
    return page.to(layer.device, non_blocking=True) if hasattr(page, "to") else page


class RankCache:
    def __init__(
        self, engine: Any, num_slots: int, num_host_pages: int, block_size: int, write_through: bool
    ):
        self.engine = engine
        self.scheduler = engine.scheduler
        self.cache_engine = engine.cache_engine
        self.pages = PageMover(self.cache_engine.gpu_cache, num_host_pages)
        self.cache = PrefixCache(
            max(1, num_slots), block_size, num_host_pages, store=self, write_through=write_through
        )
        self.block_size = block_size
        self.bound: dict[int, int] = {}  # GPU-tier slot -> engine block pinned for it
        self.snapshots: OrderedDict[BlockHash, Any] = OrderedDict()  # key ending at P -> state at P
        self.max_snapshots = 4 * (num_slots + num_host_pages) + 64
        self._promote_into: list[int] = []  # engine blocks receiving this allocation's promotions

    # ---- KVStore (called by PrefixCache) --------------------------------------------------------
    def copy_device_to_host(self, pairs: list[tuple[int, int]]) -> None:
        for slot, page in pairs:
            self.pages.device_to_host(self.bound[slot], page)

    def copy_host_to_device(self, pairs: list[tuple[int, int]]) -> None:
        # A promoted page lands in the new sequence's own block, which the cache then pins.
        for (page, slot), block in zip(pairs, self._promote_into, strict=False):
            self.pages.host_to_device(page, block)
            self._rebind(slot, block)

    # ---- lookup and admission -------------------------------------------------------------------
    def resumable_blocks(self, hashes: list[BlockHash], prompt_len: int, keep_tokens: int) -> int:
        """Blocks of the longest cached prefix P that can be resumed: P <= prompt_len - KEEP
        (bounded replay), and a state snapshot exists at P."""
        limit = max(0, prompt_len - keep_tokens) // self.block_size
        n = self.cache.match(hashes[:limit]).blocks
        while n > 0 and hashes[n - 1] not in self.snapshots:
            n -= 1
        return n

    def admit(
        self, seq: Any, request_id: str, hashes: list[BlockHash], n: int, session: str | None
    ) -> tuple[int, int]:
        """Copy the cached prefix of n blocks into seq (already allocated by try_allocate_seq).
        Returns (device tokens, host tokens) served from the cache."""
        table = list(seq.block_table)  # the patched read-only binding
        prompt_len = len(seq.token_ids)
        self._promote_into = table[self.cache.match(hashes[:n]).device_blocks : n]
        try:
            alloc = self.cache.allocate(request_id, hashes[:n], n, session_id=session, num_tokens=prompt_len)
        except OutOfBlocks:  # every GPU-tier slot is in use: no room to promote; run it cold
            n = 0
            alloc = self.cache.allocate(request_id, [], 0, session_id=session, num_tokens=prompt_len)
        finally:
            self._promote_into = []
        for i in range(alloc.cached_blocks_device):
            self.pages.device_to_device(self.bound[alloc.block_table[i]], table[i])
        if n:
            snapshot = self.snapshots[hashes[n - 1]]
            self.snapshots.move_to_end(hashes[n - 1])
            P = n * self.block_size
            self.cache_engine.load_state_from_store_to_prefill_cache(
                seq.state_id, P, snapshot, self.cache_engine.gpu_states
            )
            seq.num_cached_tokens = P
        bs = self.block_size
        return alloc.cached_blocks_device * bs, alloc.cached_blocks_host * bs

    # ---- commit at release (finalize_seq) -------------------------------------------------------
    def commit(
        self, seq: Any, request_id: str, hashes: list[BlockHash], snapshots: dict[int, Any] | None = None
    ) -> int:
        """Pin seq's full valid blocks under hashes (GPU tier), then drop the request's entry.
        Runs inside finalize_seq, before the parent frees the sequence. Returns blocks committed."""
        table = list(seq.block_table)
        held = len(self.cache.block_table(request_id))
        appended: list[int] = []
        for i in range(held, len(hashes)):
            try:
                slot = self.cache.append_block(request_id)
            except Exception:  # no slot free or evictable: commit what fits
                hashes = hashes[:i]
                break
            self._rebind(slot, table[i])
            appended.append(slot)
        self.cache.release(request_id, hashes)
        for slot in appended:  # a key that already lived in another slot: this one went back free
            if self.cache.pool.block_hash[slot] is None:
                self._unbind(slot)
        found = dict(snapshots or {})
        if hashes:
            end = len(hashes) * self.block_size
            try:
                found[end] = self.cache_engine.select_state_slice_to_store(seq.state_id, end)
            except (ValueError, AssertionError):  # not kept: an earlier snapshot will have to do
                pass
        for position in sorted(found):
            n = position // self.block_size
            if 0 < n <= len(hashes) and hashes[n - 1] in self.cache.pool.index:
                self.snapshots[hashes[n - 1]] = found[position]
                self.snapshots.move_to_end(hashes[n - 1])
        while len(self.snapshots) > self.max_snapshots:
            self.snapshots.popitem(last=False)
        return len(appended)

    def drop(self, request_id: str) -> None:
        """Forget the request's entry without committing anything (errors, the final-token bug)."""
        if request_id in self.cache._seqs:  # noqa: SLF001 - PrefixCache has no 'holds' query
            self.cache.release(request_id, [])

    # ---- eviction for the prefill watermark -----------------------------------------------------
    def evict_for(self, free_blocks_needed: int) -> int:
        """Unpin least valuable GPU-tier blocks until the engine has free_blocks_needed free
        blocks or nothing more can go. Evicted keys are demoted to the host tier when there is one."""
        evicted = 0
        pool, policy = self.cache.pool, self.cache.policy
        while self.scheduler.get_num_free_blocks() < free_blocks_needed and len(policy):
            now = time.monotonic()
            slot = policy.pop_victim(now)
            if slot is None:
                break
            key = pool.block_hash[slot]
            assert key is not None
            if self.cache.num_host_blocks and self.cache.host.lookup(key) is None:
                page, gone = self.cache.host.put(key)
                if gone is not None:
                    self.cache.stats.host_evicted_blocks += 1
                    self.cache.stats.dropped_blocks += 1
                if page is not None:
                    self.copy_device_to_host([(slot, page)])
                    self.cache.stats.demoted_blocks += 1
            elif not self.cache.num_host_blocks:
                self.cache.stats.dropped_blocks += 1
            del pool.index[key]
            pool.block_hash[slot] = None
            policy.forget(slot)
            pool.free.append(slot)
            self.cache.stats.evicted_blocks += 1
            self._unbind(slot)
            evicted += 1
        return evicted

    # ---- bindings -------------------------------------------------------------------------------
    def _rebind(self, slot: int, block: int) -> None:
        self._unbind(slot)  # a reused slot: its old block (evicted, maybe demoted) is let go
        self.scheduler.pin_blocks([block])
        self.bound[slot] = block

    def _unbind(self, slot: int) -> None:
        block = self.bound.pop(slot, None)
        if block is not None:
            self.scheduler.unpin_blocks([block])

    @property
    def num_pinned(self) -> int:
        return len(self.bound)

    def check(self) -> None:
        """Invariants: cache invariants hold; exactly the indexed slots are bound (pinned)."""
        self.cache.check_invariants()
        indexed = {slot for slot, key in enumerate(self.cache.pool.block_hash) if key is not None}
        assert set(self.bound) == indexed, (sorted(self.bound), sorted(indexed))
        assert len(set(self.bound.values())) == len(self.bound), "one engine block bound twice"
