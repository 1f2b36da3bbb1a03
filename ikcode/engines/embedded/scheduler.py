"""Which sequences run in the next step, and with how many tokens.

Each step: every running sequence that is decoding gets one token (growing its block table when
it crosses a block boundary); then prefills, in arrival order, share the step's token budget
(chunked prefill), first the ones already running, then newly admitted ones. A waiting request is
admitted only when the cache can give it blocks for its whole prompt; otherwise it keeps waiting
(back-pressure). When a decode cannot get a block, the newest running sequence is preempted back to
the queue: its valid full blocks are committed to the cache on the way out, so its re-admission is
mostly a cache hit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ikcode.cache import OutOfBlocks, PrefixCache
from ikcode.engines.embedded.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of this sequence run in this step


def committable_hashes(seq: Sequence, block_size: int) -> list:
    """Keys of the full blocks whose K/V is valid: what may be committed when seq lets go."""
    return seq.block_hashes(seq.num_computed_tokens, block_size)


class Scheduler:
    def __init__(
        self,
        cache: PrefixCache,
        max_num_seqs: int,
        max_prefill_tokens: int,
        on_admit: Callable[[Sequence], None],
    ):
        self.cache = cache
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.on_admit = on_admit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def schedule(self) -> list[ScheduledSeq]:
        out: list[ScheduledSeq] = []
        # Decodes first: a running agent's next token never waits behind someone's prefill.
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or not seq.is_decoding:
                continue
            if not self._grow(seq):
                continue  # seq itself was preempted
            out.append(ScheduledSeq(seq, 1))
        # Prefills already under way keep at most half the budget while others wait, so a long
        # prompt in progress never shuts out a short one (it finishes within a few steps).
        budget = self.max_prefill_tokens
        can_admit = self.waiting and len(self.running) < self.max_num_seqs
        continuing = budget - budget // 2 if can_admit else budget
        for seq in self.running:
            if continuing <= 0:
                break
            if seq.status is SequenceStatus.RUNNING and not seq.is_decoding and seq.num_pending_tokens > 0:
                n = min(seq.num_pending_tokens, continuing)
                if self._grow(seq, n):
                    out.append(ScheduledSeq(seq, n))
                    budget -= n
                    continuing -= n
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break  # back-pressure: it waits until blocks come back
            self.waiting.popleft()
            n = min(seq.num_pending_tokens, budget)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        # A sequence scheduled early in this pass may have been preempted later in it.
        return [s for s in out if s.seq.status is SequenceStatus.RUNNING]

    def _admit(self, seq: Sequence) -> bool:
        tokens = seq.token_ids
        hashes = seq.block_hashes(len(tokens), self.block_size)
        try:
            alloc = self.cache.allocate(
                seq.seq_id,
                hashes,
                self.blocks_needed(len(tokens)),
                session_id=seq.request.session_id,
                num_tokens=len(tokens),
            )
        except OutOfBlocks:
            return False
        seq.block_table = list(alloc.block_table)
        cached_dev = alloc.cached_blocks_device * self.block_size
        cached_host = alloc.cached_blocks_host * self.block_size
        # At least the last token is computed: its logits give the first output token.
        seq.num_computed_tokens = min(cached_dev + cached_host, len(tokens) - 1)
        if seq.num_preemptions == 0:
            seq.stats.cached_tokens_device = min(cached_dev, seq.num_computed_tokens)
            seq.stats.cached_tokens_host = min(
                cached_host, seq.num_computed_tokens - seq.stats.cached_tokens_device
            )
            seq.stats.computed_tokens = len(tokens) - seq.num_computed_tokens
            seq.stats.admitted_at = time.monotonic()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.on_admit(seq)
        return True

    def _grow(self, seq: Sequence, num_tokens: int = 1) -> bool:
        """Make room for num_tokens more K/V rows; preempt the newest other sequence if needed."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_tokens)
        while len(seq.block_table) < needed:
            try:
                seq.block_table.append(self.cache.append_block(seq.seq_id))
            except OutOfBlocks:
                victim = self._newest_running()
                self.preempt(victim)
                if victim is seq:
                    return False
        return True

    def _newest_running(self) -> Sequence:
        return [s for s in self.running if s.status is SequenceStatus.RUNNING][-1]

    def preempt(self, seq: Sequence) -> None:
        self.cache.release(seq.seq_id, committable_hashes(seq, self.block_size), step=False)
        self.running.remove(seq)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """Take seq out of the queues (it finished, failed or was aborted)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
