"""Stand-in for DeepInfer's C++ Scheduler (csrc/engine/scheduler.hpp) as seen from Python."""

from __future__ import annotations

from collections import deque

from .memory import BLOCK_SIZE, YOCO_KEEP_TOKENS, BlockManager, StateSlots
from .sequence import Sequence, SequenceStatus

PREFILL_WATERMARK = 0.9  # prefill admission stalls past 90% block usage (scheduler.hpp:80, 313)


class Scheduler:
    def __init__(self, blocks: BlockManager, states: StateSlots, max_num_seqs: int, chunk_tokens: int):
        self.blocks = blocks
        self.states = states
        self.max_num_seqs = max_num_seqs
        self.chunk_tokens = chunk_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_cached_tokens_reported = 0  # the engine's own stat: always 0 (scheduler.hpp:340, 549, 658)

    # ---- the Python surface (pybind_scheduler.cpp:65-73, Scheduler.try_allocate_seq) ---------------
    def try_allocate_seq(self, seq: Sequence) -> bool:
        """Blocks for the whole prompt and one state slot, or nothing (no partial allocation)."""
        need = -(-len(seq.token_ids) // BLOCK_SIZE)
        if need > self.blocks.num_free:
            return False
        slot = self.states.allocate()
        if slot is None:  # state slots are the scarce resource (cache_engine.py:201-202)
            return False
        seq._blocks = [self.blocks.allocate() for _ in range(need)]
        seq.state_id = slot
        return True

    def add_sequence(self, seq: Sequence) -> None:
        assert seq.state_id >= 0, "add_sequence of a sequence that try_allocate_seq did not allocate"
        if seq.num_cached_tokens:
            # Bounded replay: a resumed prefix must leave at least KEEP tokens to prefill
            # (facts: "a hit must back off to P <= new_len - KEEP, rounded down to 128").
            assert seq.num_cached_tokens % BLOCK_SIZE == 0
            assert len(seq.token_ids) - seq.num_cached_tokens >= YOCO_KEEP_TOKENS, (
                f"resumed at {seq.num_cached_tokens} of {len(seq.token_ids)}: fewer than KEEP tokens left"
            )
        seq.num_written = seq.num_cached_tokens
        if not seq.num_cached_tokens:
            self.states.ring[seq.state_id] = 0  # a cold prefill starts from an empty window
        self.waiting.append(seq)

    def free_seq(self, seq: Sequence) -> None:
        """Frees blocks and state (called by finalize_seq; callers free aborted WAITING ones)."""
        if seq.status is SequenceStatus.FREED:
            return
        for block in seq._blocks:
            self.blocks.decref(block)
        seq._blocks = []
        if seq.state_id >= 0:
            self.states.release(seq.state_id)
            seq.state_id = -1
        seq.status = SequenceStatus.FREED
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def pin_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            self.blocks.incref(b)

    def unpin_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            self.blocks.decref(b)

    def get_num_free_blocks(self) -> int:
        return self.blocks.num_free

    # ---- scheduling -----------------------------------------------------------------------------
    def usage(self) -> float:
        return 1.0 - self.blocks.num_free / self.blocks.num_usable

    def schedule(self) -> tuple[str, list[tuple[Sequence, int]]]:
        """A prefill step (chunked, no finished sequences collected: scheduler.hpp:549) when a
        prefill can run, else a decode step over every running sequence."""
        budget = self.chunk_tokens
        out: list[tuple[Sequence, int]] = []
        for seq in self.running:
            prefilling = seq.num_written < len(seq.token_ids) - 1
            if seq.status is SequenceStatus.RUNNING and prefilling and budget > 0:
                n = min(budget, len(seq.token_ids) - seq.num_written)
                out.append((seq, n))
                budget -= n
        while (
            budget > 0
            and self.waiting
            and len(self.running) < self.max_num_seqs
            and self.usage() <= PREFILL_WATERMARK  # the stall: scheduler.hpp:80, 313
        ):
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(budget, len(seq.token_ids) - seq.num_written)
            out.append((seq, n))
            budget -= n
        if out:
            return "prefill", out
        return "decode", [(s, 1) for s in self.running if s.status is SequenceStatus.RUNNING]

    def finished(self) -> list[Sequence]:
        return [s for s in self.running if s.status is SequenceStatus.FINISHED]
