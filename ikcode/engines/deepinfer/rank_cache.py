"""The prefix cache on one DeepInfer rank: ikcode's PrefixCache as index and policy, DeepInfer's
own KV blocks as the GPU tier (pinned), host RAM pages as the host tier.

A GPU-tier slot of the PrefixCache is bound to one engine block that the cache keeps pinned
(`pin_blocks`, pybind_scheduler.cpp:65-73: a block is free when its refcount is 0,
block_manager.hpp:88-103) so that `free_seq` leaves it alone. A hit is copied into the new
sequence's own blocks (D2D from pinned blocks, H2D from host pages) together with the
sliding-window state snapshot taken at the same 128 boundary (cache_engine.py:762-848). The hit's
slots are then bound to the sequence's copies, which the sequence never writes (a hit stops
before the prompt's last token), and the blocks copied from are unpinned once the copy has run:
a turn holds its prefix once, and the cache entry stays valid whatever becomes of the sequence
(its pinned blocks outlive free_seq and preemption).
Everything here runs on the rank's engine thread, except `match` (under the rank's lock).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from ikcode.cache import BlockHash, OutOfBlocks, PrefixCache
from ikcode.engines.deepinfer.copies import PageMover, host_tensor, state_to_host


def _nbytes(snapshot: Any) -> int:
    return int(getattr(snapshot, "nbytes", 0))


class RankCache:
    def __init__(
        self,
        engine: Any,
        num_slots: int,
        num_host_pages: int,
        block_size: int,
        write_through: bool,
        host_pages: Any = None,
        extra_state_tokens: int = 128,
        max_snapshot_bytes: int = 2 * 1024**3,
        policy: str = "lru",
    ):
        self.engine = engine
        self.scheduler = engine.scheduler
        self.blocks = engine.block_manager  # pin_blocks / unpin_blocks (pybind_scheduler.cpp:65-73)
        self.cache_engine = engine.driver_worker.cache_engine  # llm_engine.py:797, worker/base.py:271
        self.state_cache = self.cache_engine.gpu_states
        self.interface = self.cache_engine.gpu_cache  # a GPUCacheInterface (cache_engine.py:540)
        self.pages = PageMover(self.cache_engine.gpu_blocks, host_pages)  # host: set when the pool arrives
        self.cache = PrefixCache(
            max(1, num_slots),
            block_size,
            num_host_pages,
            store=self,
            policy=policy,
            write_through=write_through,
            on_dropped=self._key_dropped,
        )
        self.block_size = block_size
        self.bound: dict[int, int] = {}  # GPU-tier slot -> engine block pinned for it
        # key ending at P -> the window state at P (what makes the prefix up to P resumable), in
        # host memory outside both tiers: bounded in bytes, least recently used first, and
        # dropped with its key (_key_dropped).
        self.snapshots: OrderedDict[BlockHash, Any] = OrderedDict()
        self.snapshot_bytes = 0
        self.max_snapshot_bytes = max_snapshot_bytes
        self._promote_into: list[int] = []  # engine blocks receiving this allocation's promotions
        self.copy_sources: list[int] = []  # blocks copied from and let go by the cache, still pinned
        self.copying_from: set[int] = set()  # blocks with a device-to-host copy queued since the last event
        self.copy_done: Any = None  # an event after the copies queued so far (None on a CPU)
        # DEEPINFER_PREFILL_STORE_EXTRA_SIZE: how far behind a sequence's last position its ring
        # still holds a whole window (environ.py:164)
        self.extra_state_tokens = extra_state_tokens

    # ---- KVStore (called by PrefixCache) --------------------------------------------------------
    def copy_device_to_host(self, pairs: list[tuple[int, int]]) -> None:
        for slot, page in pairs:
            block = self.bound[slot]
            self.pages.device_to_host(block, page)
            self.copying_from.add(block)  # unpinned only after the copy (_unbind, release_copied)
        if pairs:
            self.copy_done = self.pages.mark()

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
        prompt_len = int(seq.get_len())  # a Sequence has no token_ids in Python (pybind_sequence.cpp:106)
        self._promote_into = table[self.cache.match(hashes[:n]).device_blocks : n]
        try:
            alloc = self.cache.allocate(request_id, hashes[:n], n, session_id=session, num_tokens=prompt_len)
        except OutOfBlocks:  # every GPU-tier slot is in use: no room to promote; run it cold
            n = 0
            alloc = self.cache.allocate(request_id, [], 0, session_id=session, num_tokens=prompt_len)
        finally:
            self._promote_into = []
        # The prompt's blocks past the resumable prefix are computed: those dropped lately are
        # regret, as a plain PrefixCache.allocate of the whole prompt would count them.
        self.cache.note_missed(hashes[n:], time.monotonic())
        try:
            for i in range(alloc.cached_blocks_device):
                slot = alloc.block_table[i]
                source = self.bound[slot]
                self.pages.device_to_device(source, table[i])
                # The slot now points at the sequence's copy (the turn holds its prefix once);
                # the block it was copied from is unpinned once the copy has run (release_copied).
                self.blocks.pin_blocks([table[i]])
                self.bound[slot] = table[i]
                self.copy_sources.append(source)
        finally:
            if self.copy_sources:
                self.copy_done = self.pages.mark()
        if n:
            snapshot = self.snapshots[hashes[n - 1]]
            self.snapshots.move_to_end(hashes[n - 1])
            P = n * self.block_size
            snapshot = host_tensor(snapshot)
            if hasattr(snapshot, "to"):  # from page-locked memory: queued, not waited for
                snapshot = snapshot.to(self.state_cache.device, non_blocking=True)
            self.interface.load_state_from_store_to_prefill_cache(seq.state_id, P, snapshot, self.state_cache)
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
            snapshot = self.select_state(seq, end)
            if snapshot is not None:
                found[end] = snapshot
        for position in sorted(found):
            n = position // self.block_size
            if 0 < n <= len(hashes) and hashes[n - 1] in self.cache.pool.index:
                self._keep_snapshot(hashes[n - 1], found[position])
        return len(appended)

    # ---- window snapshots -----------------------------------------------------------------------
    def _keep_snapshot(self, key: BlockHash, snapshot: Any) -> None:
        self._drop_snapshot(key)
        self.snapshots[key] = snapshot
        self.snapshot_bytes += _nbytes(snapshot)
        while self.snapshot_bytes > self.max_snapshot_bytes and self.snapshots:
            self._drop_snapshot(next(iter(self.snapshots)))

    def _drop_snapshot(self, key: BlockHash) -> None:
        snapshot = self.snapshots.pop(key, None)
        if snapshot is not None:
            self.snapshot_bytes -= _nbytes(snapshot)

    def _key_dropped(self, key: BlockHash) -> None:
        """A key left a tier with no copy below it: its snapshot goes unless the other tier
        still holds the key (write-through keeps a device key in the host tier too)."""
        if key not in self.cache.pool.index and key not in self.cache.host.index:
            self._drop_snapshot(key)

    def select_state(self, seq: Any, position: int) -> Any:
        """The window ending at position, in host memory; None when the ring no longer holds it.
        DeepInfer does not check that (cache_engine.py:762-818, state_cache.py:12-34): the ring
        keeps the last window + extra_state_tokens positions, and up to one more is in flight
        under zero-overhead scheduling."""
        held = int(seq.num_cached_tokens)
        if position % self.block_size or not held - self.extra_state_tokens + 1 <= position <= held:
            return None
        return state_to_host(
            self.interface.select_state_slice_to_store(seq.state_id, position, self.state_cache)
        )

    def release_copied(self, wait: bool = False) -> int:
        """Unpin the blocks copied from (hit sources, blocks demoted to the host tier) once their
        copies have run. Called before each step's admissions, as DeepInfer releases the sources
        of its own block clones a step later (DeferredRelease, llm_engine.py:67-118): the event
        is only asked, not waited for, since waiting would wait for the forward queued before
        the copies. wait: the blocks are needed now (evict_for). Returns the blocks released."""
        if self.copy_done is not None:
            if not wait and not self.copy_done.query():
                return 0
            self.copy_done.synchronize()
        self.copy_done = None
        self.copying_from.clear()
        if not self.copy_sources:
            return 0
        released, self.copy_sources = self.copy_sources, []
        self.blocks.unpin_blocks(released)
        return len(released)

    def drop(self, request_id: str) -> None:
        """Forget the request's entry without committing anything (errors, the final-token bug)."""
        if request_id in self.cache._seqs:  # noqa: SLF001 - PrefixCache has no 'holds' query
            self.cache.release(request_id, [])

    # ---- eviction for the prefill watermark -----------------------------------------------------
    def evict_for(self, free_blocks_needed: int, keep: list[BlockHash] | None = None) -> int:
        """Unpin least valuable GPU-tier blocks until the engine has free_blocks_needed free
        blocks or nothing more can go. Evicted keys are demoted to the host tier when there is one.
        Blocks still held as the source of a copy count as free: they are made so at the end,
        waiting for their copies if the engine is still short of free blocks.
        keep: the prefix the coming allocation will hit, evicted only when nothing else can go
        (the allocation takes the whole prompt before the hit's copy gives those blocks back)."""
        pool = self.cache.pool
        reachable = self.blocks.get_num_free_blocks() + len(self.copy_sources) + len(self.cache.policy)
        if reachable < free_blocks_needed:
            # Even every evictable block would not make room (running sequences hold the rest):
            # the request waits, and evicting now would only empty the GPU tier, again each time
            # the waiting request is looked at.
            return 0
        spared = [pool.index[key] for key in keep or () if key in pool.index]
        for slot in spared:
            pool.pin(slot)  # out of the policy's reach for the first pass
        try:
            evicted = self._evict(free_blocks_needed)
        finally:
            pool.unref(spared, time.monotonic(), None, step=False)
        evicted += self._evict(free_blocks_needed)
        if self.copy_sources and self.blocks.get_num_free_blocks() < free_blocks_needed:
            self.release_copied(wait=True)  # _evict counted them free: make them so
        return evicted

    def _evict(self, free_blocks_needed: int) -> int:
        evicted = 0
        pool, policy = self.cache.pool, self.cache.policy
        while self.blocks.get_num_free_blocks() + len(self.copy_sources) < free_blocks_needed and len(policy):
            now = time.monotonic()
            slot = policy.pop_victim(now)
            if slot is None:
                break
            key = pool.block_hash[slot]
            assert key is not None
            gone, lost = None, not self.cache.num_host_blocks
            if self.cache.num_host_blocks and self.cache.host.lookup(key) is None:
                page, gone = self.cache.host.put(key)
                if page is not None:
                    self.copy_device_to_host([(slot, page)])
                    self.cache.stats.demoted_blocks += 1
                else:  # every host page pinned: the key is lost
                    lost = True
            del pool.index[key]
            pool.block_hash[slot] = None
            policy.forget(slot)
            pool.free.append(slot)
            self.cache.stats.evicted_blocks += 1
            # PrefixCache's own bookkeeping: a key the host let go is dropped only when the device
            # does not hold it, and a dropped key is remembered (the ghost list's regret metric).
            self.cache._host_evicted(gone, now)  # noqa: SLF001
            if lost:
                self.cache._dropped(key, now)  # noqa: SLF001
            self._unbind(slot)
            evicted += 1
        return evicted

    # ---- bindings -------------------------------------------------------------------------------
    def _rebind(self, slot: int, block: int) -> None:
        self._unbind(slot)  # a reused slot: its old block (evicted, maybe demoted) is let go
        self.blocks.pin_blocks([block])
        self.bound[slot] = block

    def _unbind(self, slot: int) -> None:
        block = self.bound.pop(slot, None)
        if block is None:
            return
        if block in self.copying_from:  # its copy to the host tier may not have run yet
            self.copy_sources.append(block)
        else:
            self.blocks.unpin_blocks([block])

    @property
    def num_pinned(self) -> int:
        return len(self.bound)

    def check(self) -> None:
        """Invariants: cache invariants hold; exactly the indexed slots are bound (pinned)."""
        self.cache.check_invariants()
        indexed = {slot for slot, key in enumerate(self.cache.pool.block_hash) if key is not None}
        assert set(self.bound) == indexed, (sorted(self.bound), sorted(indexed))
        held = self.cache.pool.index.keys() | self.cache.host.index.keys()
        assert self.snapshots.keys() <= held, "a snapshot kept for a key neither tier holds"
        assert self.snapshot_bytes == sum(_nbytes(v) for v in self.snapshots.values())
        assert self.snapshot_bytes <= self.max_snapshot_bytes
        assert len(set(self.bound.values())) == len(self.bound), "one engine block bound twice"
