"""SimulatedServer: a data-parallel DeepInfer server in virtual time, behind ikcode's real admission.

What runs here is what runs live, as code or as the engine does it:
- admission: the live AdmissionController's policy and its per-rank gate (the same objects; only
  the clock is virtual; the engine view offers rank_loads() and placement() as a data-parallel
  engine does, ikcode.engines.placement), or, for the `fifo` baseline, arrival order with no gate;
- routing: the DeepInfer adapter's SessionRouter (engines/deepinfer/routing.py), fed with each
  rank's cached prefix and its requests waiting for their prefill, as DeepInferEngine.submit does;
- memory: one real PrefixCache per rank (SimRank);
- the engine's own step settings: the `fifo` baseline runs DeepInfer 0.1.0's defaults (a whole
  prompt per prefill step, votes every 70 / 100 decode steps: the published system); the ikcode
  rows run the settings ikcode's DeepInfer adapter passes live (`schedule`: DeepInferConfig.schedule,
  the profile's [deepinfer] table);
- the engine's own step decisions (DeepInfer 0.1.0, csrc/engine/scheduler.hpp): every rank steps in
  lockstep and a step is prefill or decode for all of them. Prefill is tried after every
  `prefill_attempt_interval` decode steps when ALL ranks want it and after every
  `prefill_any_attempt_interval` when ANY does (scheduler.hpp:306-336); a rank wants it when it
  has work waiting and its block usage is at most 90% (scheduler.hpp:80, 313). A step lasts as
  long as its slowest rank, plus the PCIe copies each rank's engine thread made before it.

Stretches of decode steps with nothing to decide are advanced at once, which is what makes an
hour of hundreds of agents take seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace

from ikcode.admission import AdmissionConfig, AdmissionController
from ikcode.engines.base import (
    CacheLookup,
    EngineInfo,
    EngineLoad,
    LifecycleEvent,
    LifecycleKind,
    LifecycleListener,
    RequestStats,
)
from ikcode.engines.deepinfer.routing import SessionRouter
from ikcode.engines.placement import Placement
from ikcode.plan import session_limit

from .hardware import HardwareModel
from .rank import SimRank, SimRequest

AFFINITY_MAX_IMBALANCE = 8  # DeepInferConfig.affinity_max_imbalance's default


class _EngineView:
    """What the AdmissionController sees of the engine: its info, load and lifecycle events."""

    def __init__(self, server: SimulatedServer):
        self.server = server
        self.info = EngineInfo(
            model_name="simulated", context_window=server.hw.max_num_batched_tokens, vocab_size=0,
            eos_token_ids=(), block_size=server.block_size, kind="simulated",
        )  # fmt: skip
        self.listeners: list[LifecycleListener] = []

    def load(self) -> EngineLoad:
        total = EngineLoad()
        for load in self.rank_loads():
            total.running += load.running
            total.waiting += load.waiting
            total.kv_blocks_total += load.kv_blocks_total
            total.kv_blocks_used += load.kv_blocks_used
        return total

    def uncached_tokens(self, req: SimRequest) -> int:
        """What a queued request would compute now (the gate's re-check of a warm ticket that
        waited, as live admission looks the prompt up again)."""
        return self.server.lookup(req).uncached_tokens

    def rank_loads(self) -> list[EngineLoad]:
        """Each rank's memory as its allocation sees it: the reserve above the prefill watermark
        is never given to a sequence (rank.allocate_pending)."""
        return [
            EngineLoad(
                running=len(rank.waiting) + len(rank.decoding),
                waiting=len(rank.pending),
                kv_blocks_total=rank.total_blocks - rank.reserve_blocks,
                kv_blocks_used=rank.used_blocks(),
            )
            for rank in self.server.ranks
        ]

    def placement(self, req: SimRequest, admitting: list[int]) -> Placement:
        """The rank the adapter's router would pick for req now, and what its allocation takes."""
        rank = self.server.route(req, admitting, record=False)
        return Placement(rank, self.server.ranks[rank].blocks_to_take(req))

    def add_listener(self, listener: LifecycleListener) -> None:
        self.listeners.append(listener)

    def emit(self, kind: LifecycleKind, req: SimRequest) -> None:
        stats = RequestStats(prompt_tokens=req.prompt_tokens, computed_tokens=req.computed)
        event = LifecycleEvent(kind, req.request_id, self.server.now, stats)
        for listener in self.listeners:
            listener(event)


class SimulatedServer:
    def __init__(
        self,
        hardware: HardwareModel,
        admission: AdmissionConfig,
        block_size: int = 2048,
        cache_policy: str = "lru",
        schedule: Mapping[str, int] | None = None,
    ):
        ikcode = admission.policy != "fifo"
        # Admission's limit on sessions at once is plan's on these figures, as `ikcode up` sets it.
        limit = session_limit(hardware, dict(schedule or {}))
        if ikcode and schedule:
            hardware = replace(hardware, **schedule)
        self.hw = hardware
        self.block_size = block_size
        self.now = 0.0
        clock: Callable[[], float] = lambda: self.now  # noqa: E731 - the cache's and admission's clock
        self.ranks = [
            SimRank(i, hardware, block_size, host_tier=ikcode,
                    cache_policy=cache_policy, clock=clock)
            for i in range(hardware.cards)
        ]  # fmt: skip
        self.router = SessionRouter(hardware.cards, AFFINITY_MAX_IMBALANCE)
        self.view = _EngineView(self)
        self.controller = AdmissionController(self.view, admission, clock, limit)  # type: ignore[arg-type]
        self.policy = self.controller.policy
        self.gate = ikcode  # the baseline has no admission layer: arrival order, no memory gate
        self.decode_steps = 0  # all decode steps so far (finish times are counted in these)
        self.since_prefill = 0  # decode steps since the last prefill step (the vote's clock)
        self.steps = 0
        self.prefill_steps = 0
        self.busy_s = 0.0
        self.failed: list[SimRequest] = []

    # ---- the client side -------------------------------------------------------------------
    def lookup(self, req: SimRequest) -> CacheLookup:
        """The best rank's cached prefix, as DeepInferEngine.lookup reports it."""
        keys = req.keys(req.prompt_tokens // self.block_size)
        best = CacheLookup(req.prompt_tokens)
        for rank in self.ranks:
            m = rank.cache.match(keys)
            found = CacheLookup(
                req.prompt_tokens, m.device_blocks * self.block_size, m.host_blocks * self.block_size
            )
            if found.cached_tokens > best.cached_tokens:
                best = found
        return best

    def submit(self, req: SimRequest) -> None:
        """Classify and queue, as AdmissionController.submit; raises EngineOverloaded when shed."""
        ticket = self.policy.make_ticket(req.request_id, self.lookup(req), self.now, req.session_id, req)
        self.policy.offer(ticket, self.now)

    @property
    def idle(self) -> bool:
        return not self.policy.queue and not any(r.num_active() for r in self.ranks)

    # ---- admission and routing -------------------------------------------------------------
    def _admit(self) -> None:
        if self.policy.queue:
            gate = self.controller._gate() if self.gate else None  # noqa: SLF001 - the live gate
            for ticket in self.policy.admit(self.now, gate):
                req = ticket.payload
                req.rank = self.route(req)
                self.ranks[req.rank].pending.append(req)
        for rank in self.ranks:
            for req in rank.allocate_pending():
                usable = rank.total_blocks - rank.reserve_blocks
                req.failed = (
                    f"rank {rank.index}: needs {rank.blocks_needed(req)} KV blocks, has {usable} "
                    f"under the prefill watermark"
                )
                req.finished_at = self.now  # it ended here: the steady state still starts
                self.failed.append(req)
                self.view.emit(LifecycleKind.FINISHED, req)
                if req.on_finished:
                    req.on_finished(req)

    def route(self, req: SimRequest, admitting: list[int] | None = None, record: bool = True) -> int:
        """The rank DeepInferEngine.submit would give req: the adapter's SessionRouter on each
        rank's cached prefix, requests waiting for their prefill (plus `admitting`) and the blocks
        they compute there (DeepInferEngine._work).
        record=False leaves the router as it was (SessionRouter.peek: admission only asks)."""
        keys = req.keys(req.prompt_tokens // self.block_size)
        ranks, extra = self.ranks, admitting or [0] * len(self.ranks)
        blocks = -(-req.prompt_tokens // self.block_size)
        cached = [rank.cache.match(keys).blocks for rank in ranks]
        pick = self.router.route if record else self.router.peek
        rank = pick(
            req.session_id,
            lambda r: cached[r],
            lambda r: ranks[r].num_queued() + extra[r],
            lambda r: ranks[r].queued_blocks() + blocks - cached[r],
        )
        if record:
            req.prefill_blocks = blocks - cached[rank]
        return rank

    # ---- one step --------------------------------------------------------------------------
    def _vote(self) -> bool:
        """Whether the next step is a prefill step (scheduler.hpp:306-336)."""
        hw, d = self.hw, self.since_prefill
        wants = [r.wants_prefill() for r in self.ranks]
        any_point = d != 0 and d % hw.prefill_any_attempt_interval == 0
        all_point = d % hw.prefill_attempt_interval == 0
        if any_point:
            return any(wants)
        return all_point and all(wants)

    def _steps_to_vote(self) -> float:
        """Decode steps until the next point where the vote would pass as things stand."""
        hw, d = self.hw, self.since_prefill
        wants = [r.wants_prefill() for r in self.ranks]
        if not any(wants):
            return math.inf
        any_int = hw.prefill_any_attempt_interval
        best = (d // any_int + 1) * any_int - d
        if all(wants):
            all_int = hw.prefill_attempt_interval
            best = min(best, -(-d // all_int) * all_int - d or all_int)
        return best

    def step(self, horizon: float) -> None:
        """One engine step, or many decode steps not crossing `horizon`."""
        self._admit()
        copy_s = max(r.take_copy_seconds() for r in self.ranks)
        if self._vote():
            self._prefill_step(copy_s)
            return
        busy = any(r.decoding for r in self.ranks)
        to_vote = self._steps_to_vote()
        if not busy and to_vote == math.inf:
            # Nothing runs: wait for the next arrival, or for a session slot to free.
            wake_s = self.policy.next_change_s(self.now)
            until = horizon if wake_s is None else min(horizon, self.now + max(wake_s, 1e-3))
            self.now = max(self.now + copy_s, until)
            return
        step_s = max(r.decode_seconds() for r in self.ranks)
        finishes = [r.next_finish() for r in self.ranks if r.decoding]
        to_finish = min(finishes) - self.decode_steps if finishes else math.inf
        to_horizon = math.floor((horizon - self.now - copy_s) / step_s) if horizon < math.inf else math.inf
        n = int(max(1, min(to_vote, to_finish, to_horizon)))
        seconds = copy_s + n * step_s
        self.now += seconds
        self.busy_s += seconds
        self.steps += n
        self.decode_steps += n
        self.since_prefill += n
        for rank in self.ranks:
            for req in rank.finished(self.decode_steps):
                self._finish(req)

    def _prefill_step(self, copy_s: float) -> None:
        done: list[SimRequest] = []
        longest = 0.0
        for rank in self.ranks:
            if rank.wants_prefill():
                seconds, finished = rank.prefill()
                longest = max(longest, seconds)
                done.extend(finished)
        seconds = copy_s + longest
        self.now += seconds
        self.busy_s += seconds
        self.steps += 1
        self.prefill_steps += 1
        self.since_prefill = 0
        for req in done:
            req.first_token_at = self.now
            self.view.emit(LifecycleKind.FIRST_TOKEN, req)
            if req.on_first_token:
                req.on_first_token(req)
            rank = self.ranks[req.rank]
            rank.start_decode(req, self.decode_steps)
            for finished in rank.finished(self.decode_steps):  # a one-token answer
                self._finish(finished)

    def _finish(self, req: SimRequest) -> None:
        req.finished_at = self.now
        self.view.emit(LifecycleKind.FINISHED, req)
        if req.on_finished:
            req.on_finished(req)
