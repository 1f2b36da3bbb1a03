"""PrefixCache: the engine-agnostic prefix cache (device tier + optional host tier).

The engine owns the KV bytes; this owns the index and the policy. Lifecycle of a sequence:
  allocate(seq, keys, n)   longest cached prefix pinned (device) or promoted (host); the rest
                           fresh blocks, evicting unreferenced cached blocks by policy
  append_block(seq)        decode growth
  release(seq, committed)  the ENGINE gave the sequence back (possibly steps after its final
                           token): its first len(committed) blocks hold valid KV for those keys.
                           Commit them, then drop the references.
Committing at release, never at the final token, is the point: an engine that closes a
sequence one step after its last token would otherwise miss on every request, silently.

Two more rules keep the index honest:
  copy, then commit   a block enters an index only after its bytes are where the index says;
                      a failed tier copy rolls the whole allocation back (OutOfBlocks-like: the
                      cache is as it was, less what the copy's evictions already dropped).
  no shared writes    a hit covers at most num_tokens - 1 tokens (as vLLM caps it): the last
                      prompt token is always computed, and its K/V row must land in a block of
                      this sequence's own, never in a committed block another sequence may read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice, takewhile

from .block_pool import BlockPool
from .ghost import GhostList
from .hashing import BlockHash
from .host_tier import HostTier
from .policy import EvictionPolicy, make_policy
from .stats import CacheStats
from .types import Allocation, KVStore, Match, OutOfBlocks


@dataclass
class _Sequence:
    table: list[int]
    sharer: str  # session id when known, else the sequence id


class PrefixCache:
    def __init__(
        self,
        num_device_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        store: KVStore | None = None,
        policy: str | EvictionPolicy = "lru",
        *,
        write_through: bool = False,
        bytes_per_block: int = 0,
        clock: Callable[[], float] = time.monotonic,
        ghost_capacity: int | None = None,
        on_dropped: Callable[[BlockHash], None] | None = None,
    ):
        if block_size <= 0:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.policy = make_policy(policy)
        self.pool = BlockPool(num_device_blocks, self.policy)
        self.host = HostTier(num_host_blocks)
        self.store = store  # None: nobody moves bytes (simulation, trace replay)
        self.write_through = write_through and num_host_blocks > 0
        self.clock = clock
        self.stats = CacheStats(bytes_per_block=bytes_per_block)
        cap = 2 * (num_device_blocks + num_host_blocks) + 1024
        cap = ghost_capacity if ghost_capacity is not None else cap
        self.ghost = GhostList(cap)
        self._seqs: dict[str, _Sequence] = {}
        # Told when a key leaves a tier with no copy kept below it (what an engine keeps beside
        # a block, e.g. DeepInfer's window snapshots, can then go too).
        self.on_dropped = on_dropped

    # ---- lookup ------------------------------------------------------------------------------
    def match(self, hashes: list[BlockHash]) -> Match:
        """Longest cached prefix of hashes, device part then host part. No side effects.

        The scans run in C (takewhile over the index's __contains__): a 450K-token prompt has
        28K blocks, and a Python loop over them cost ~3 ms per lookup."""
        d = len(list(takewhile(self.pool.index.__contains__, hashes)))
        h = 0
        if self.num_host_blocks:
            # The host run stops at a key the device also holds (both tiers hold a promoted or
            # written-through key): a promotion into a fresh block could not be indexed, the key
            # being the device's already. Such a block is computed again instead.
            run = list(takewhile(self.host.index.__contains__, islice(hashes, d, None)))
            both = self.pool.index.keys() & run  # a set operation: empty in the common case
            h = next(i for i, key in enumerate(run) if key in both) if both else len(run)
        return Match(device_blocks=d, host_blocks=h)

    def num_free_blocks(self) -> int:
        """Device blocks that can be handed out now: free + evictable."""
        return self.pool.num_available()

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= self.pool.num_available()

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._seqs[seq_id].table)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.pool.index)

    # ---- allocate / grow -------------------------------------------------------------------
    def allocate(
        self,
        seq_id: str,
        hashes: list[BlockHash],
        num_blocks: int,
        *,
        session_id: str | None = None,
        num_tokens: int | None = None,
        counted: bool = True,
    ) -> Allocation:
        """A block table of num_blocks device blocks reusing the cached prefix of hashes.

        num_tokens: the prompt length. When given, the hit stops one token short of it (the
        engine recomputes the last prompt token, and that write must go to a fresh block); it
        also feeds hit accounting (default num_blocks * block_size).
        counted: False for a sequence admitted again after a preemption: the request was counted
        once (its second lookup hits the blocks it committed itself on the way out).
        Raises OutOfBlocks (nothing changed) when the fresh blocks cannot be found; a failed tier
        copy is rolled back and its error raised.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        hashes = hashes[: min(num_blocks, self.reusable_blocks(num_tokens, num_blocks))]
        m = self.match(hashes)
        d, h = m.device_blocks, m.host_blocks
        hits = [self.pool.index[k] for k in hashes[:d]]
        needed = num_blocks - d
        available = self.pool.num_available() - sum(1 for b in hits if self.pool.refcount[b] == 0)
        if needed > available:
            raise OutOfBlocks(needed, available)

        now = self.clock()
        sharer = session_id or seq_id
        for b in hits:
            self.pool.pin(b)
            self.policy.on_hit(b, sharer)
        host_slots = [self.host.index[k] for k in hashes[d : d + h]]
        for slot in host_slots:
            self.host.pin(slot)
        # Regret is judged before this allocation's own evictions push anything out of memory.
        self.note_missed(hashes[d + h :], now)
        demotions: list[tuple[int, int]] = []
        fresh = [self._take_block(now, demotions) for _ in range(needed)]
        promotions = list(zip(host_slots, fresh[:h], strict=True))
        try:
            self._copy(demotions, promotions)
        except BaseException:
            self._roll_back(hits, fresh, host_slots, demotions, now)
            raise
        self._unpin_demoted(demotions)
        # The bytes are in place: only now may the index point at them.
        for (_slot, block), key in zip(promotions, hashes[d : d + h], strict=True):
            committed = self.pool.commit(block, key, sharer)
            assert committed, "a host-tier key was also on the device"
        for slot in host_slots:
            self.host.unpin(slot)

        self._seqs[seq_id] = _Sequence(table=hits + fresh, sharer=sharer)
        s = self.stats
        s.promoted_blocks += h
        if counted:
            s.requests += 1
            s.query_tokens += num_tokens if num_tokens is not None else num_blocks * self.block_size
            s.query_blocks += num_blocks
            s.hit_blocks_device += d
            s.hit_blocks_host += h
            s.hit_tokens_device += d * self.block_size
            s.hit_tokens_host += h * self.block_size
        return Allocation(block_table=hits + fresh, cached_blocks_device=d, cached_blocks_host=h)

    def append_block(self, seq_id: str) -> int:
        seq = self._seqs[seq_id]
        if self.pool.num_available() == 0:
            raise OutOfBlocks(1, 0)
        demotions: list[tuple[int, int]] = []
        now = self.clock()
        block = self._take_block(now, demotions)
        try:
            self._copy(demotions, [])
        except BaseException:
            self._roll_back([], [block], [], demotions, now)
            raise
        self._unpin_demoted(demotions)
        seq.table.append(block)
        return block

    # ---- release -----------------------------------------------------------------------------
    def release(
        self,
        seq_id: str,
        committed_hashes: list[BlockHash],
        *,
        session_id: str | None = None,
        hold_s: float | None = None,
        step: bool = True,
    ) -> None:
        """Commit the first len(committed_hashes) blocks of seq_id's table, then unreference all.

        hold_s: the session is expected back soon (its last step ended in a tool call): a policy
        that understands holds keeps this sequence's blocks on the device for that long.
        step: this release ends one of the session's steps (a reply was given). A preemption or
        an abort is not a step: a policy that protects returning sessions must not count it.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"sequence {seq_id!r} holds no blocks")
        now = self.clock()
        sharer = session_id or seq.sharer
        written: list[tuple[int, int]] = []
        for block, key in zip(seq.table, committed_hashes, strict=False):
            if self.pool.block_hash[block] is not None:
                continue  # a hit or a promoted block: already indexed
            if not self.pool.commit(block, key, sharer):
                continue  # the key lives in another block already; this one will be freed
            self.ghost.discard(key)
            if self.write_through and self.host.lookup(key) is None:  # the host may have it already
                slot, host_evicted = self.host.put(key)
                self._host_evicted(host_evicted, now)
                if slot is not None and self.host.slot_hash[slot] == key:
                    self.host.pin(slot)  # as in _take_block: no second key in it before the copy
                    written.append((block, slot))
        try:
            if written:
                self._copy(written, [])
                self.stats.demoted_blocks += len(written)
                self._unpin_demoted(written)
        except BaseException:
            for _block, slot in written:  # the host copies never landed: forget them
                key = self.host.drop(slot)
                if key not in self.pool.index:  # committed to the device just now: not dropped
                    self._dropped(key, now)
            raise
        finally:  # the sequence is gone from _seqs: its references must go too, whatever happened
            hold_until = now + hold_s if hold_s else None
            self.pool.unref(seq.table, now, hold_until, sharer, step=step)

    def reusable_blocks(self, num_tokens: int | None, num_blocks: int) -> int:
        """How many leading blocks of a num_tokens prompt a hit may cover: (num_tokens-1)//size.

        The last prompt token is always run (its logits give the first output token), and its
        K/V row is written into the block that holds it: that block must be this sequence's own.
        """
        if num_tokens is None:
            return num_blocks
        return max(0, num_tokens - 1) // self.block_size

    # ---- internals ---------------------------------------------------------------------------
    def _roll_back(
        self,
        hits: list[int],
        fresh: list[int],
        host_slots: list[int],
        demotions: list[tuple[int, int]],
        now: float,
    ) -> None:
        """Undo an allocation whose tier copy failed: nothing half-made stays indexed or owned."""
        self.stats.demoted_blocks -= len(demotions)
        for _block, slot in demotions:  # the evicted keys never reached the host: they are gone
            self._dropped(self.host.drop(slot), now)
        self.pool.unref(fresh, now, None, step=False)  # uncommitted: back to the free list
        self.pool.unref(hits, now, None, step=False)  # committed hits: evictable again
        for slot in host_slots:
            self.host.unpin(slot)

    def _take_block(self, now: float, demotions: list[tuple[int, int]]) -> int:
        block, evicted = self.pool.take(now)
        if evicted is None:
            return block
        self.stats.evicted_blocks += 1
        if not self.num_host_blocks:
            self._dropped(evicted, now)
            return block
        slot = self.host.lookup(evicted)
        if slot is not None:  # already there (write-through or an earlier promotion): free demotion
            self.host.touch(slot)
            return block
        slot, host_evicted = self.host.put(evicted)
        self._host_evicted(host_evicted, now)
        if slot is None:  # every host slot pinned by this very allocation
            self._dropped(evicted, now)
        else:
            # Pinned until the copy is done: a later demotion of the same call must not take
            # this slot again (two copies into one slot, and a roll-back that drops it twice).
            self.host.pin(slot)
            demotions.append((block, slot))
            self.stats.demoted_blocks += 1
        return block

    def _unpin_demoted(self, demotions: list[tuple[int, int]]) -> None:
        for _block, slot in demotions:
            self.host.unpin(slot)

    def note_missed(self, keys: list[BlockHash], now: float) -> None:
        """Keys a request asked for and no tier held: those dropped not long ago are regret."""
        for key in keys:
            evicted_at = self.ghost.pop(key)
            if evicted_at is not None:
                self.stats.record_regret(now - evicted_at)

    def _host_evicted(self, key: BlockHash | None, now: float) -> None:
        if key is not None:
            self.stats.host_evicted_blocks += 1
            if key not in self.pool.index:  # else it is still on the device: not dropped yet
                self._dropped(key, now)

    def _dropped(self, key: BlockHash, now: float) -> None:
        self.stats.dropped_blocks += 1
        self.ghost.add(key, now)
        if self.on_dropped is not None:
            self.on_dropped(key)

    def _copy(self, demotions: list[tuple[int, int]], promotions: list[tuple[int, int]]) -> None:
        # Demotions first: a promotion may land in a device block that was just demoted.
        if self.store is None:
            return
        if demotions:
            t0 = time.perf_counter()
            self.store.copy_device_to_host(demotions)
            self.stats.demote_seconds += time.perf_counter() - t0
        if promotions:
            t0 = time.perf_counter()
            self.store.copy_host_to_device(promotions)
            self.stats.promote_seconds += time.perf_counter() - t0

    # ---- truth -------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, float | int]:
        """Counters (CacheStats.to_dict) plus gauges of the tiers' current occupancy."""
        d = self.stats.to_dict()
        d["prefix_cache_device_blocks"] = self.num_device_blocks
        d["prefix_cache_device_blocks_cached"] = len(self.pool.index)
        d["prefix_cache_device_blocks_free"] = self.pool.num_available()
        d["prefix_cache_host_blocks"] = self.num_host_blocks
        d["prefix_cache_host_blocks_used"] = len(self.host)
        d["prefix_cache_host_bytes_used"] = len(self.host) * self.stats.bytes_per_block
        return d

    def check_invariants(self) -> None:
        self.pool.check()
        self.host.check()
        assert not self.host.pinned, "host slots left pinned after an allocation"
        users = [0] * self.num_device_blocks
        for seq in self._seqs.values():
            assert len(set(seq.table)) == len(seq.table), "a block appears twice in one table"
            for b in seq.table:
                users[b] += 1
        assert users == self.pool.refcount, "refcounts disagree with the live block tables"
