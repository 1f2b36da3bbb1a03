"""SimulatedServer: a GPU server in virtual time, driving the REAL admission policy and cache.

A discrete-event engine: each step decodes one token for every running sequence and prefills
up to the chunk budget (split by the admission policy's plan_prefill), and costs what the
HardwareModel says. Stretches with nothing to prefill advance many decode steps at once, which
is what makes an hour of hundreds of agents take seconds.

Memory is the real PrefixCache over blocks of `block_size` tokens: a request holds device
blocks for its prompt and output from admission to release; host-tier hits are reloaded over
the modelled PCIe bandwidth (serialized) before the request can prefill; commit happens at
release, as in a real engine.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ikcode.admission import AdmissionConfig, AdmissionPolicy, RequestClass, Ticket
from ikcode.cache import OutOfBlocks, PrefixCache
from ikcode.engines.base import CacheLookup

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
    ticket: Ticket | None = None
    cached_device: int = 0
    cached_host: int = 0
    computed: int = 0
    prefill_pos: int = 0
    ready_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    on_first_token: Callable[[SimRequest], None] | None = None
    on_finished: Callable[[SimRequest], None] | None = None

    def keys(self, blocks: int) -> list[int]:
        base = self.conversation * KEY_SPACE
        return list(range(base, base + blocks))


class SimulatedServer:
    def __init__(
        self,
        hardware: HardwareModel,
        admission: AdmissionConfig,
        block_size: int = 2048,
        cache_policy: str = "lru",
    ):
        self.hw = hardware
        self.bs = block_size
        self.now = 0.0
        self.cache = PrefixCache(
            hardware.device_tier_tokens // block_size,
            block_size,
            hardware.host_tier_tokens // block_size,
            policy=cache_policy,
            bytes_per_block=hardware.kv_bytes_per_token * block_size,
            clock=lambda: self.now,
        )
        self.policy = AdmissionPolicy(admission)
        self.engine_queue: deque[SimRequest] = deque()  # handed to the engine, waiting for memory
        self.prefilling: list[SimRequest] = []
        self._decode: list[tuple[int, int, SimRequest]] = []  # (finish at decode step, seq, request)
        self._decode_steps = 0
        self._decode_ctx = 0
        self._seq = 0
        self._pcie_free_at = 0.0
        self._promised = 0  # blocks of requests admitted but not yet allocated
        self._dirty = True  # something changed that may let admission or allocation proceed
        self.steps = 0
        self.busy_s = 0.0

    # ---- the client side -------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        """Classify and queue; raises EngineOverloaded when admission sheds it."""
        blocks = req.prompt_tokens // self.bs
        m = self.cache.match(req.keys(blocks))
        lookup = CacheLookup(req.prompt_tokens, m.device_blocks * self.bs, m.host_blocks * self.bs)
        ticket = self.policy.make_ticket(req.request_id, lookup, req.arrived_at, req.session_id, req)
        self.policy.offer(ticket, self.now)
        req.ticket = ticket
        self._dirty = True

    @property
    def idle(self) -> bool:
        return not (self.policy.queue or self.engine_queue or self.prefilling or self._decode)

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self._decode)

    # ---- admission and allocation ----------------------------------------------------------
    def _blocks_needed(self, req: SimRequest) -> int:
        return -(-(req.prompt_tokens + req.output_tokens) // self.bs)

    def _fits(self, ticket: Ticket) -> bool:
        req: SimRequest = ticket.payload
        if self.running + len(self.engine_queue) >= self.hw.max_num_seqs:
            return False
        # Device hits count too: an unreferenced cached block is "free or evictable" until this
        # request pins it, so only the whole table is a safe test. Tickets approved earlier in
        # the same admission round have not allocated yet: count them.
        need = self._blocks_needed(req)
        if need + self._promised > self.cache.num_free_blocks():
            return False
        self._promised += need
        return True

    def _admit(self) -> None:
        fits = None if self.policy.fifo else self._fits
        self._promised = sum(self._blocks_needed(r) for r in self.engine_queue)
        for ticket in self.policy.admit(self.now, fits):
            req: SimRequest = ticket.payload
            req.admitted_at = self.now
            self.engine_queue.append(req)
        while self.engine_queue and self.running < self.hw.max_num_seqs:
            req = self.engine_queue[0]
            try:
                alloc = self.cache.allocate(
                    req.request_id,
                    req.keys(req.prompt_tokens // self.bs),
                    self._blocks_needed(req),
                    session_id=req.session_id,
                    num_tokens=req.prompt_tokens,
                )
            except OutOfBlocks:
                break  # first come first served: the head waits for memory
            self.engine_queue.popleft()
            cached = min(req.prompt_tokens - 1, alloc.cached_blocks * self.bs)
            req.cached_device = min(cached, alloc.cached_blocks_device * self.bs)
            req.cached_host = cached - req.cached_device
            req.computed = req.prompt_tokens - cached
            req.prefill_pos = cached
            start = max(self.now, self._pcie_free_at)
            req.ready_at = start + self.hw.reload_seconds(req.cached_host)
            if req.cached_host:
                self._pcie_free_at = req.ready_at
            self.prefilling.append(req)
        self._dirty = False

    # ---- one step --------------------------------------------------------------------------
    def step(self, horizon: float) -> None:
        """Advance by one engine step, or by many decode steps not crossing `horizon`."""
        if self._dirty:
            self._admit()
        ready = [r for r in self.prefilling if r.ready_at <= self.now]
        batch = len(self._decode)
        decode_s = self.hw.decode_step_seconds(batch, self._decode_ctx)
        if ready:
            assert all(r.ticket is not None for r in ready)
            pending = [(r.ticket, r.prompt_tokens - r.prefill_pos) for r in ready]
            grants = self.policy.plan_prefill(self.hw.prefill_chunk_tokens, pending, self.now)  # type: ignore[arg-type]
            seconds = decode_s + sum(
                self.hw.prefill_seconds(r.prefill_pos, g) for r, g in zip(ready, grants, strict=True)
            )
            steps = 1
        elif batch:
            next_event = min([horizon] + [r.ready_at for r in self.prefilling])
            until_finish = self._decode[0][0] - self._decode_steps
            if next_event < math.inf:
                until_finish = min(until_finish, math.floor((next_event - self.now) / decode_s))
            steps = max(1, until_finish)
            seconds = decode_s * steps
            grants = []
        else:
            self.now = max(self.now, min([horizon] + [r.ready_at for r in self.prefilling]))
            return
        self.now += seconds
        self.busy_s += seconds
        if ready:
            cold = RequestClass.COLD
            pairs = zip(ready, grants, strict=True)
            ran_cold = any(g and r.ticket and r.ticket.cls is cold for r, g in pairs)
            self.policy.on_step(seconds, ran_cold)
        self.steps += steps
        if batch:
            self._decode_steps += steps
            self._decode_ctx += batch * steps
        for req, granted in zip(ready, grants, strict=True):
            req.prefill_pos += granted
            if req.prefill_pos >= req.prompt_tokens:
                self._first_token(req)
        while self._decode and self._decode[0][0] <= self._decode_steps:
            self._finish(heapq.heappop(self._decode)[2])

    def _first_token(self, req: SimRequest) -> None:
        self.prefilling.remove(req)
        req.first_token_at = self.now
        self.policy.on_first_token(req.request_id, self.now, req.computed)
        self._dirty = True
        if req.on_first_token:
            req.on_first_token(req)
        self._seq += 1
        self._decode_ctx += req.prompt_tokens + 1
        heapq.heappush(self._decode, (self._decode_steps + req.output_tokens - 1, self._seq, req))

    def _finish(self, req: SimRequest) -> None:
        req.finished_at = self.now
        self._decode_ctx -= req.prompt_tokens + req.output_tokens
        total = req.prompt_tokens + req.output_tokens
        self.cache.release(req.request_id, req.keys(total // self.bs), session_id=req.session_id)
        self.policy.on_done(req.request_id)
        self._dirty = True
        if req.on_finished:
            req.on_finished(req)
