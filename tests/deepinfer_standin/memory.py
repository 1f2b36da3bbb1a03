"""Stand-in for DeepInfer's KV memory: 128-token blocks, refcounts with pin/unpin, scarce state
slots, and the worker's cache engine (pages + sliding-window state snapshots).

Every behaviour cites what it mirrors in deepinfer==0.1.0 (see /work/shared/facts/deepinfer.md).
The "KV" of a position is the token id written there: a page copied wrongly, or a state snapshot
not loaded, changes what the stand-in model generates, so cache bugs show up as wrong answers.
"""

from __future__ import annotations

import os

import numpy as np

BLOCK_SIZE = 128  # KVSTORE_GRAIN / block size: model_metadata_utils.py:133-135
WINDOW = 64  # sliding-window ring length of the stand-in (the real one is per SWA layer)
YOCO_KEEP_TOKENS = 140  # DEEPINFER_YOCO_PREFILL_KEEP_TOKENS used by the facts file


class BlockManager:
    """Refcounted blocks (csrc C++ BlockManager). Block 0 is reserved and never handed out
    (facts: "Block 0 is reserved"); pin/unpin/free counts as in pybind_scheduler.cpp:65-73."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 reserved

    def allocate(self) -> int:
        if not self.free:
            raise MemoryError("no free KV block")
        block = self.free.pop()
        self.refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        assert 0 < block < self.num_blocks and self.refcount[block] > 0, f"pin of a free block {block}"
        self.refcount[block] += 1

    def decref(self, block: int) -> None:
        assert self.refcount[block] > 0, f"block {block} refcount would go negative"
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free.append(block)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1


class StateSlots:
    """Per-sequence sliding-window state slots: only ~1.2 x max_num_seqs exist
    (worker/cache_engine.py:201-202). A slot is handed out with its previous user's ring in it."""

    def __init__(self, max_num_seqs: int):
        self.num_slots = max(1, int(1.2 * max_num_seqs))
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.ring = np.zeros((self.num_slots, WINDOW), dtype=np.int64)
        # DEEPINFER_PREFILL_STORE_EXTRA_STATE=1 keeps the window at 128 boundaries until close.
        self.boundary_rings: list[dict[int, np.ndarray]] = [{} for _ in range(self.num_slots)]

    def allocate(self) -> int | None:
        if not self.free:
            return None
        slot = self.free.pop()
        self.boundary_rings[slot] = {}  # the ring itself is NOT cleared: garbage until loaded
        return slot

    def release(self, slot: int) -> None:
        assert slot not in self.free, f"state slot {slot} freed twice"
        self.free.append(slot)


class CacheEngine:
    """worker/cache_engine.py: the KV pages (gpu_cache, one array per layer; one layer here) and
    the state store (gpu_states), with the withheld cache system's state hooks (:762-848)."""

    def __init__(self, num_blocks: int, max_num_seqs: int):
        self.gpu_cache = [np.full((num_blocks, BLOCK_SIZE), -1, dtype=np.int64)]
        self.gpu_states = StateSlots(max_num_seqs)
        self.fail_next_state_load = False  # fault injection for the tests

    def select_state_slice_to_store(self, state_id: int, num_tokens: int) -> np.ndarray:
        """Snapshot of the ring ending at num_tokens (cache_engine.py:762-848). Only kept at 128
        boundaries when DEEPINFER_PREFILL_STORE_EXTRA_STATE=1 (facts: resumed prefix)."""
        assert os.environ.get("DEEPINFER_PREFILL_STORE_EXTRA_STATE") == "1", (
            "select_state_slice_to_store needs DEEPINFER_PREFILL_STORE_EXTRA_STATE=1"
        )
        rings = self.gpu_states.boundary_rings[state_id]
        if num_tokens not in rings:
            raise ValueError(f"no state kept at {num_tokens} (kept: {sorted(rings)})")
        return rings[num_tokens].copy()

    def load_state_from_store_to_prefill_cache(
        self, state_id: int, num_tokens: int, snapshot: np.ndarray, gpu_states: StateSlots
    ) -> None:
        """cache_engine.py:762-848; the loader asserts bounded replay (YOCO compact) is on (:836-837)."""
        assert os.environ.get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE") == "compact", (
            "load_state_from_store_to_prefill_cache requires DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact"
        )
        assert num_tokens % BLOCK_SIZE == 0, "a resumed prefix is 128-aligned"
        if self.fail_next_state_load:
            self.fail_next_state_load = False
            raise RuntimeError("injected state-load failure")
        gpu_states.ring[state_id] = snapshot
        gpu_states.boundary_rings[state_id] = {num_tokens: snapshot.copy()}
