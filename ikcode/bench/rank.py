"""SimRank: one DeepInfer data-parallel rank in virtual time: its own KV memory, queues and work.

Memory is the real ikcode PrefixCache over the rank's own KV blocks (the card's memory less its
share of the weights). A request holds blocks for its whole prompt and output from allocation
to release, as DeepInfer allocates a sequence's blocks before its prefill
(`_can_allocate_with_state(seq->get_num_blocks())`, scheduler.hpp:386); a head that does not fit
waits and everything behind it waits too (`LATER -> break`, scheduler.hpp:387-388). Allocation
leaves the block reserve above the 90% watermark (scheduler.hpp:80, 313) free, as the adapter's
evict_for(blocks + reserve) does before try_allocate_seq, and a sequence's output blocks are
counted from the start, so decode never runs out of blocks: the preemption path
(scheduler.hpp:766-790, which with EngineArgs' default stop_preempted_request=True,
arg_utils.py:40, ends the request) is not reached, as the published runs' zero failures say.

What differs by policy is what runs live:
- `host_tier`: ikcode's cache demotes every evicted block to host RAM and reloads it over this
  card's PCIe link (rank_cache.evict_for / RankCache.admit). The published baseline's host tier
  rescued only idle sessions; an agent's conversation is busy until the agent leaves it, and a
  conversation left never returns, so its rescues never serve a turn: off.
A GPU-tier hit is held once: the adapter copies it into the sequence's own blocks and unpins the
cached copy once the copy is enqueued (RankCache.admit), so the sequence's blocks are all a turn
holds, as the shared, referenced hit blocks are here.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ikcode.cache import PrefixCache

from .hardware import HardwareModel

KEY_SPACE = 1 << 24  # blocks per conversation in the synthetic key space


@dataclass(eq=False)
class SimRequest:
    request_id: str
    conversation: int  # keys of block i: conversation * KEY_SPACE + i (append-only, so chained)
    prompt_tokens: int
    output_tokens: int
    arrived_at: float
    session_id: str | None = None
    rank: int = -1
    cached_device: int = 0
    cached_host: int = 0
    computed: int = 0
    remaining: int = 0  # prompt tokens still to prefill
    prefill_blocks: int = 0  # blocks the router counted it for on its rank (not cached there)
    first_token_at: float | None = None
    finished_at: float | None = None
    failed: str = ""
    on_first_token: Callable[[SimRequest], None] | None = None
    on_finished: Callable[[SimRequest], None] | None = None

    def keys(self, blocks: int) -> list[int]:
        base = self.conversation * KEY_SPACE
        return list(range(base, base + blocks))


class SimRank:
    def __init__(
        self,
        index: int,
        hw: HardwareModel,
        block_size: int,
        *,
        host_tier: bool,
        cache_policy: str,
        clock: Callable[[], float],
    ):
        self.index = index
        self.hw = hw
        self.block_size = block_size
        self.total_blocks = max(1, hw.kv_tokens_per_card // block_size)
        self.reserve_blocks = math.ceil((1.0 - hw.prefill_watermark) * self.total_blocks)
        host_blocks = hw.host_tier_tokens // hw.cards // block_size if host_tier else 0
        self.cache = PrefixCache(
            self.total_blocks,
            block_size,
            host_blocks,
            policy=cache_policy,
            bytes_per_block=hw.kv_bytes_per_token * block_size,
            clock=clock,
        )
        self.pending: deque[SimRequest] = deque()  # routed here, no blocks yet
        self.waiting: deque[SimRequest] = deque()  # allocated, prefill not finished (FCFS)
        self.decoding: list[tuple[int, int, SimRequest]] = []  # (last decode step, order, request)
        self.context_tokens = 0  # tokens the decode batch attends to
        self.copy_s = 0.0  # PCIe copies the engine thread does before its next step
        self.copied_tokens = 0
        self._order = 0

    # ---- memory --------------------------------------------------------------------------------
    def used_blocks(self) -> int:
        """Blocks referenced by sequences (cached, unreferenced ones can be evicted)."""
        return self.total_blocks - self.cache.num_free_blocks()

    def usage(self) -> float:
        return self.used_blocks() / self.total_blocks

    def num_active(self) -> int:
        return len(self.pending) + len(self.waiting) + len(self.decoding)

    def num_queued(self) -> int:
        """Requests waiting for their prefill (the router's load, as DeepInferEngine._queued)."""
        return len(self.pending) + len(self.waiting)

    def queued_blocks(self) -> int:
        """Blocks the requests waiting for their prefill compute, as counted when they were routed
        (the router's work, as DeepInferEngine._work)."""
        return sum(r.prefill_blocks for r in self.pending) + sum(r.prefill_blocks for r in self.waiting)

    def blocks_needed(self, req: SimRequest) -> int:
        return -(-(req.prompt_tokens + req.output_tokens) // self.block_size)

    def allocate_pending(self) -> list[SimRequest]:
        """Allocate the pending queue's head while it fits (first come, first served). Returns
        requests that can never fit (more than the rank gives one sequence, its blocks under the
        prefill watermark): they fail. One between that and the whole rank waited for ever, the
        run's clock at infinity."""
        never: list[SimRequest] = []
        while self.pending:
            req = self.pending[0]
            need, hits, keys = self._need(req)
            if self.blocks_to_take(req) + self.reserve_blocks > self.cache.num_free_blocks():
                if not self.waiting and not self.decoding and need > self.total_blocks - self.reserve_blocks:
                    never.append(self.pending.popleft())
                    continue
                break
            self.pending.popleft()
            self._allocate(req, keys, need)
        return never

    def _need(self, req: SimRequest) -> tuple[int, int, list[int]]:
        """(blocks the sequence holds, of which device hits, its prompt's block keys)."""
        need = self.blocks_needed(req)
        keys = req.keys(req.prompt_tokens // self.block_size)
        return need, min(self.cache.match(keys).device_blocks, need), keys

    def blocks_to_take(self, req: SimRequest) -> int:
        """Blocks req's allocation takes out of the free-or-evictable pool: its fresh blocks, plus
        the hits no running sequence holds, which stop being evictable once pinned."""
        need, hits, keys = self._need(req)
        pool = self.cache.pool
        idle_hits = sum(1 for k in keys[:hits] if pool.refcount[pool.index[k]] == 0)
        return need - hits + idle_hits

    def _allocate(self, req: SimRequest, keys: list[int], need: int) -> None:
        stats = self.cache.stats
        moved_before = stats.promoted_blocks + stats.demoted_blocks
        alloc = self.cache.allocate(
            req.request_id, keys, need, session_id=req.session_id, num_tokens=req.prompt_tokens
        )
        moved = stats.promoted_blocks + stats.demoted_blocks - moved_before
        if moved:
            self.copy_s += self.hw.copy_seconds(moved * self.block_size)
            self.copied_tokens += moved * self.block_size
        bs = self.block_size
        cached = min(req.prompt_tokens - 1, alloc.cached_blocks * bs)
        req.cached_device = min(cached, alloc.cached_blocks_device * bs)
        req.cached_host = cached - req.cached_device
        req.computed = req.prompt_tokens - cached
        req.remaining = req.computed
        self.waiting.append(req)

    # ---- the engine's steps ----------------------------------------------------------------------
    def wants_prefill(self) -> bool:
        """The rank's vote (scheduler.hpp:313): work waiting and block usage under the watermark."""
        return bool(self.waiting) and self.usage() <= self.hw.prefill_watermark

    def prefill(self) -> tuple[float, list[SimRequest]]:
        """One prefill step: FCFS up to max_num_batched_tokens; a prompt cut by the budget ends the
        step (scheduler.hpp:469-473, 543-545). Returns (seconds, requests whose prefill finished)."""
        budget = self.hw.max_num_batched_tokens
        done: list[SimRequest] = []
        tokens = 0
        while self.waiting and budget > 0:
            req = self.waiting[0]
            take = min(req.remaining, budget)
            req.remaining -= take
            tokens += take
            budget -= take
            if req.remaining > 0:
                break
            done.append(self.waiting.popleft())
        return self.hw.prefill_seconds(tokens), done

    def start_decode(self, req: SimRequest, decode_steps: int) -> None:
        self._order += 1
        self.context_tokens += req.prompt_tokens
        heapq.heappush(self.decoding, (decode_steps + req.output_tokens - 1, self._order, req))

    def decode_seconds(self) -> float:
        return self.hw.decode_step_seconds(self.context_tokens)

    def next_finish(self) -> int | None:
        return self.decoding[0][0] if self.decoding else None

    def finished(self, decode_steps: int) -> list[SimRequest]:
        out: list[SimRequest] = []
        while self.decoding and self.decoding[0][0] <= decode_steps:
            req = heapq.heappop(self.decoding)[2]
            self.context_tokens -= req.prompt_tokens
            self.release(req)
            out.append(req)
        return out

    def release(self, req: SimRequest) -> None:
        """The engine frees the sequence: commit its full blocks."""
        total = req.prompt_tokens + req.output_tokens
        self.cache.release(req.request_id, req.keys(total // self.block_size), session_id=req.session_id)

    def take_copy_seconds(self) -> float:
        seconds, self.copy_s = self.copy_s, 0.0
        return seconds
