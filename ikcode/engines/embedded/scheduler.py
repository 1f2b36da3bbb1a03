"""The one owner of every sequence's state: which sequences exist, where each stands, and which
run in the next step with how many tokens.

A sequence is in `seqs` from submit to release, in arrival order, and its `status` says where it
is: WAITING (holds no blocks), RUNNING (holds blocks; prefilling or decoding) or FINISHED (last
token out, still holding its blocks until its release step). Every change of status is a method
here, and every call into the scheduler is made under the engine's lock: requests arrive on the
gateway's threads and the engine thread steps.

Each step: every running sequence that is decoding gets one token (growing its block table when
it crosses a block boundary); waiting requests are admitted in arrival order while seats and
blocks last; then prefills share the step's token budget (chunked prefill), shortest first, so a
warm turn's short tail is not queued behind a cold prompt (`_schedule_prefills`). A waiting
request is admitted only when the cache can give it blocks for its whole prompt; otherwise it
keeps waiting (back-pressure). When a decode cannot get a block, the newest running sequence is
preempted back to waiting: its valid full blocks are committed to the cache on the way out, so its
re-admission is mostly a cache hit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ikcode.cache import BlockHash, OutOfBlocks, PrefixCache
from ikcode.engines.embedded.sequence import Sequence, SequenceStatus

logger = logging.getLogger("ikcode.engine")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of this sequence run in this step


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # first admitted in this step
    # Sequences whose blocks could not be given (a tier copy failed): the engine fails each of
    # them alone; the others go on.
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)


def committable_hashes(seq: Sequence, block_size: int) -> list[BlockHash]:
    """Keys of the full blocks whose K/V is valid: what may be committed when seq lets go."""
    return seq.block_hashes(seq.num_computed_tokens, block_size)


class Scheduler:
    def __init__(
        self, cache: PrefixCache, max_num_seqs: int, max_prefill_tokens: int, long_prefill_chunk_tokens: int
    ):
        self.cache = cache
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.long_prefill_chunk_tokens = long_prefill_chunk_tokens
        self.seqs: dict[str, Sequence] = {}  # submitted and not yet released, arrival order

    # ---- the table ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence {seq.seq_id!r} is already known")
        seq.status = SequenceStatus.WAITING
        self.seqs[seq.seq_id] = seq

    def get(self, seq_id: str) -> Sequence | None:
        return self.seqs.get(seq_id)

    def with_status(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs.values() if s.status is status]

    def has_work(self) -> bool:
        """Anything for the engine thread to do: a sequence to run, release or abort."""
        return bool(self.seqs)

    def request_abort(self, seq_id: str) -> None:
        """Mark seq for abort; the engine thread ends it at its next step (it owns the events)."""
        seq = self.seqs.get(seq_id)
        if seq is not None and seq.status is not SequenceStatus.FINISHED:
            seq.abort_requested = True

    def take_aborted(self) -> list[Sequence]:
        aborted = [s for s in self.seqs.values() if s.abort_requested]
        for seq in aborted:
            seq.abort_requested = False
        return aborted

    def finish(self, seq: Sequence, release_at_step: int) -> None:
        """Its last token is out: it keeps its blocks until release_at_step (see `due`)."""
        seq.status = SequenceStatus.FINISHED
        seq.abort_requested = False
        seq.release_at_step = release_at_step

    def due(self, step: int) -> list[Sequence]:
        """Finished sequences whose release step has come."""
        return [
            s for s in self.seqs.values() if s.status is SequenceStatus.FINISHED and s.release_at_step <= step
        ]

    def release(
        self,
        seq: Sequence,
        committed: list[BlockHash],
        session_id: str | None = None,
        hold_s: float | None = None,
        step: bool = False,
    ) -> None:
        """Give seq's blocks back to the cache (committing `committed`) and forget it. A failed
        commit (a write-through copy) is raised after seq is forgotten: the cache has let go of
        its blocks either way, and a sequence left here would be released again every step."""
        try:
            if seq.block_table:
                self.cache.release(seq.seq_id, committed, session_id=session_id, hold_s=hold_s, step=step)
        finally:
            seq.block_table = []
            seq.status = SequenceStatus.RELEASED
            del self.seqs[seq.seq_id]

    # ---- the next step -----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        # Decodes first: a running agent's next token never waits behind a prefill.
        for seq in self.with_status(SequenceStatus.RUNNING):
            if seq.status is SequenceStatus.RUNNING and seq.is_decoding and self._grow(seq, 1, plan):
                plan.scheduled.append(ScheduledSeq(seq, 1))
        # Admission takes a seat and the prompt's blocks, no compute: only then is it known how
        # much of the prompt the cache holds, which is what orders the prefills below.
        num_running = len(self.with_status(SequenceStatus.RUNNING))
        for seq in self.with_status(SequenceStatus.WAITING):
            if num_running >= self.max_num_seqs:
                break
            try:
                admitted = self._admit(seq)
            except Exception as exc:  # a failed tier copy, rolled back: this request fails alone
                plan.failed.append((seq, exc))
                continue
            if not admitted:
                break  # back-pressure: it and those after it wait until blocks come back
            num_running += 1
            if seq.num_preemptions == 0:
                plan.admitted.append(seq)
        plan.scheduled += self._schedule_prefills(plan)
        # A sequence scheduled early in this pass may have been preempted later in it.
        plan.scheduled = [s for s in plan.scheduled if s.seq.status is SequenceStatus.RUNNING]
        return plan

    def _schedule_prefills(self, plan: StepPlan) -> list[ScheduledSeq]:
        """Share the step's prefill budget: tails first, then a chunk of a long prefill.

        A warm turn's tail (the few hundred tokens after its cached prefix) is one step from its
        first token, and that step's length is its wait: so the shortest prefills go first, each
        whole when it fits. A prefill that cannot finish in this step stays out of a step that
        carries a first token, unless it was passed over in the step before (it progresses at
        least every other step: a stream of tails never starves it). Its chunk is at most
        long_prefill_chunk_tokens, even alone: a tail that arrives during the step waits for
        the step to end, and every decode token waits for it too.
        """
        out: list[ScheduledSeq] = []
        budget = self.max_prefill_tokens
        pending = [
            s
            for s in self.with_status(SequenceStatus.RUNNING)
            if not s.is_decoding and s.num_pending_tokens > 0
        ]
        # Those passed over in the step before first (in arrival order), then the shortest: a
        # prefill the budget ran out before is passed over too, so even a stream of tails that
        # fills every step's budget lets it run every other step.
        pending.sort(key=lambda s: (0, 0) if s.prefill_passed_over else (1, s.num_pending_tokens))
        first_tokens = False
        for seq in pending:
            if budget <= 0:
                seq.prefill_passed_over = True
                continue
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted to make room for a prefill before it
            n = seq.num_pending_tokens
            if n > budget:  # a long prefill: it will not finish in this step
                if first_tokens and not seq.prefill_passed_over:
                    seq.prefill_passed_over = True
                    continue
                n = min(budget, self.long_prefill_chunk_tokens)
            if not self._grow(seq, n, plan):
                continue  # seq itself was preempted, or failed
            seq.prefill_passed_over = False
            first_tokens = first_tokens or n == seq.num_pending_tokens
            out.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    # ---- blocks ------------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _admit(self, seq: Sequence) -> bool:
        tokens = seq.token_ids
        hashes = seq.block_hashes(len(tokens), self.block_size)

        def allocate(hits: list[BlockHash]):
            return self.cache.allocate(
                seq.seq_id,
                hits,
                self.blocks_needed(len(tokens)),
                session_id=seq.request.session_id,
                num_tokens=len(tokens),
                counted=seq.num_preemptions == 0,  # its hit rate was counted when first admitted
            )

        try:
            alloc = allocate(hashes)
        except OutOfBlocks:
            return False
        except Exception:  # a failed promotion from the host tier, rolled back
            # Computed instead: the host copy of the prefix stays, and a copy that keeps
            # failing must not fail every later turn of this conversation with it.
            logger.exception("promoting %s's prefix failed; computing it instead", seq.seq_id)
            try:
                alloc = allocate(hashes[: self.cache.match(hashes).device_blocks])
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
        return True

    def _grow(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        """Make room for num_tokens more K/V rows; preempt the newest other sequence if needed.
        False when seq does not run in this step: preempted, or failed (in plan.failed)."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_tokens)
        while len(seq.block_table) < needed:
            try:
                seq.block_table.append(self.cache.append_block(seq.seq_id))
            except OutOfBlocks:
                victim = self.with_status(SequenceStatus.RUNNING)[-1]
                self._preempt(victim)
                if victim is seq:
                    return False
            except Exception as exc:  # a failed tier copy, rolled back: seq fails alone
                plan.failed.append((seq, exc))
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        try:
            self.cache.release(seq.seq_id, committable_hashes(seq, self.block_size), step=False)
        except Exception:  # a failed write-through: the blocks are released all the same
            logger.exception("cache commit failed while preempting %s", seq.seq_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
