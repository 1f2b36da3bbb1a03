"""AdmissionPolicy: the decision logic, shared by the live controller and the simulator.

It holds no threads and reads no clock: every call is given `now`, so the same object runs
behind the real gateway (wall clock) and inside the simulator (virtual clock).

Decisions:
  offer()        classify and predict TTFT at arrival; shed a NEW session's cold request whose
                 predicted TTFT exceeds the bound and that no rank can start now
                 (EngineOverloaded -> 529 + retry-after = its predicted wait), or a new session
                 when the sessions active at once are at plan's limit (admission.sessions);
                 a session is deferred at most once (its retry is queued).
  admit()        which queued requests enter the engine now: warm first, aged cold ranked with
                 warm, a new session only while the active ones are under the limit, at most
                 max_cold_prefills cold ones prefilling at once on each rank, and on each rank
                 in order while its memory lasts (the gate says where and whether).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from ikcode.engines.base import CacheLookup, EngineOverloaded

from .config import AdmissionConfig
from .rate import PrefillRateEstimator
from .sessions import SessionLimit, SessionSlots, forget_least_recent
from .stats import ClassWaits


class RequestClass(StrEnum):
    WARM = "warm"
    COLD = "cold"


@dataclass
class Ticket:
    request_id: str
    prompt_tokens: int
    uncached_tokens: int  # tokens the engine must compute (host-tier hits count as cached)
    arrived_at: float
    cls: RequestClass
    session_id: str | None = None
    running_session: bool = False  # the session was served recently: never shed
    predicted_ttft_s: float = 0.0
    admitted_at: float | None = None
    sharing: int = 1  # prefills on its rank when this one was admitted (rate estimate)
    rank: int = 0  # the engine rank it runs on (data-parallel engines; else 0)
    new_session: bool = False  # its session holds no slot (admission.sessions)
    needs_slot: bool = False  # a new session that found no slot free: it waits for one
    payload: Any = None  # what the caller needs to submit it (EngineRequest, simulated request)
    retry_key: str | None = None  # without a session id: its identity across retries (make_ticket)
    looked_up_at: float | None = None  # when uncached_tokens was read (None: at arrival)

    def aged(self, now: float, aging_s: float) -> bool:
        return self.cls is RequestClass.COLD and now - self.arrived_at >= aging_s


class Gate(Protocol):
    """Where a ticket would run and whether it fits there now (admission.gate.RankGate). A gate
    may also say how many of a ticket's tokens the engine would compute now (`uncached`, None:
    unknown): a warm ticket that waited is classified again (`admit`)."""

    def place(self, ticket: Ticket) -> int: ...

    def fits(self, ticket: Ticket) -> bool: ...


# A warm ticket queued this long is looked up again before it is admitted, and again each time
# this much longer: its prefix may have been evicted meanwhile (by the cold work admitted ahead of
# it), and admitted as warm it would prefill outside the cold cap.
RECHECK_WARM_S = 1.0


class AdmissionPolicy:
    def __init__(self, config: AdmissionConfig | None = None, session_limit: SessionLimit | None = None):
        """session_limit: the most sessions active at once for conversations of a given size
        (ikcode.plan.session_limit on the profile's [hardware]); used when the config says "plan"."""
        self.config = config or AdmissionConfig()
        c = self.config
        self.fifo = c.policy == "fifo"
        self.slots = SessionSlots(_limit(c, session_limit), c.session_idle_s, c.session_memory_s)
        self.rate = PrefillRateEstimator(c.prefill_tokens_per_s, c.rate_ema_alpha, c.rate_min_tokens)
        self.queue: list[Ticket] = []  # waiting, arrival order
        self.inflight: dict[str, Ticket] = {}  # admitted, first token not yet out
        self.waits = {RequestClass.WARM: ClassWaits(), RequestClass.COLD: ClassWaits()}
        # session id -> last admitted (or deferred) at, least recent first: ids come from a client
        # header, so it is pruned past session_memory_s and MAX_SESSIONS (sessions.py)
        self._sessions: OrderedDict[str, float] = OrderedDict()
        # Ranks of the engine (data parallel): each has its own prefill compute, so a cold read
        # takes num_ranks times the server's rate divided evenly, and the cold cap is per rank.
        self.num_ranks = 1

    # ---- arrival -----------------------------------------------------------------------------
    def classify(self, lookup: CacheLookup) -> RequestClass:
        cold = lookup.uncached_tokens > self.config.cold_threshold_tokens
        return RequestClass.COLD if cold else RequestClass.WARM

    def make_ticket(
        self,
        request_id: str,
        lookup: CacheLookup,
        now: float,
        session_id: str | None = None,
        payload: Any = None,
        retry_key: str | None = None,
    ) -> Ticket:
        """retry_key: who a request without a session id is (its user and whole prompt), so that
        its retry is known as one: deferred once, like a session, not shed on every try."""
        key = session_id or retry_key
        seen = self._sessions.get(key) if key else None
        running = seen is not None and now - seen <= self.config.session_memory_s
        return Ticket(
            request_id=request_id,
            prompt_tokens=lookup.prompt_tokens,
            uncached_tokens=lookup.uncached_tokens,
            arrived_at=now,
            cls=self.classify(lookup),
            session_id=session_id,
            running_session=running,
            payload=payload,
            retry_key=None if session_id else retry_key,
        )

    def offer(self, ticket: Ticket, now: float) -> None:
        """Queue a ticket, or raise EngineOverloaded (cold work of a new session only)."""
        c = self.config
        if len(self.queue) >= c.max_queue:
            raise EngineOverloaded(f"admission queue full ({c.max_queue})", c.max_retry_after_s)
        if self._needs_slot(ticket, now):
            ticket.needs_slot = True
            if c.shed and not ticket.running_session:
                self._defer(ticket, now)
                free_s = self.slots.seconds_to_free(now, self._queued_sessions())
                retry = c.max_retry_after_s if free_s is None else min(c.max_retry_after_s, math.ceil(free_s))
                retry = max(c.min_retry_after_s, retry)
                raise EngineOverloaded(
                    f"{self.slots.num_active()} sessions are active, the most this server carries "
                    f"at this conversation size; retry in {retry} s",
                    retry_after_s=retry,
                )
            self.queue.append(ticket)  # its retry, or no shedding: it waits for a slot here
            return
        wait_s = self.predict_wait(ticket, now)
        ticket.predicted_ttft_s = wait_s + self.prefill_seconds(ticket)
        # Shed only what cannot start before its retry would come back: the work ahead of it
        # keeps every rank busy meanwhile, so deferring it costs the server nothing, where a
        # request sent away while a rank could take it leaves that rank idle.
        if (
            not self.fifo
            and c.shed
            and ticket.cls is RequestClass.COLD
            and not ticket.running_session
            and self.rate.known
            and ticket.predicted_ttft_s > c.ttft_bound_s
            and wait_s >= c.min_retry_after_s
        ):
            self._defer(ticket, now)
            retry = min(c.max_retry_after_s, math.floor(wait_s))
            raise EngineOverloaded(
                f"predicted time to first token {ticket.predicted_ttft_s:.1f} s exceeds the "
                f"{c.ttft_bound_s:.0f} s bound for new work; retry in {retry} s",
                retry_after_s=retry,
            )
        self.queue.append(ticket)

    def _defer(self, ticket: Ticket, now: float) -> None:
        self.waits[ticket.cls].shed += 1
        if key := ticket.session_id or ticket.retry_key:
            # Deferred once: its retry is queued, not shed again, so shedding spreads a
            # burst of new sessions over time without ever failing one.
            self._saw(key, now)

    def _saw(self, session_id: str, now: float) -> None:
        self._sessions[session_id] = now
        self._sessions.move_to_end(session_id)
        forget_least_recent(self._sessions, now, lambda at: at, self.config.session_memory_s)

    def _needs_slot(self, ticket: Ticket, now: float) -> bool:
        """A new session that the sessions active at once leave no room for now (new sessions
        queued ahead of it take the next slots)."""
        if self.fifo or not self.slots.enabled:
            return False
        ticket.new_session = not (ticket.session_id and self.slots.holds(ticket.session_id, now))
        if not ticket.new_session:
            return False
        if any(t.needs_slot for t in self.queue):
            return True
        queued_new = sum(1 for t in self.queue if t.new_session)
        return not self.slots.has_room(ticket.prompt_tokens, now, queued_new, self._queued_sessions())

    def _queued_sessions(self) -> set[str | None]:
        return {t.session_id for t in self.queue}

    def prefill_seconds(self, ticket: Ticket) -> float:
        """Its own prefill, on one rank (a rank has 1/num_ranks of the server's rate)."""
        if not self.rate.known:
            return 0.0
        return ticket.uncached_tokens * max(1, self.num_ranks) / self.rate.tokens_per_s

    def predict_wait(self, ticket: Ticket, now: float) -> float:
        """Seconds before this ticket's prefill can start, at the estimated rate.

        Warm: none (it goes first). Cold (and fifo): none while a rank has a free cold slot and
        no cold work is queued; else the cold work still prefilling on the rank that frees first
        plus the queued cold work spread over the ranks.
        """
        if not self.rate.known or (ticket.cls is RequestClass.WARM and not self.fifo):
            return 0.0
        ranks = max(1, self.num_ranks)
        rank_rate = self.rate.tokens_per_s / ranks
        running = [0.0] * ranks
        cold_on = [0] * ranks
        for t in self.inflight.values():
            if self.fifo or t.cls is RequestClass.COLD:
                done = (now - (t.admitted_at or now)) * rank_rate / max(1, t.sharing)
                running[t.rank % ranks] += max(0.0, t.uncached_tokens - done)
                cold_on[t.rank % ranks] += 1
        queued = sum(
            t.uncached_tokens
            for t in self.queue
            if (self.fifo or t.cls is RequestClass.COLD) and not t.needs_slot  # slots come first
        )
        if not self.fifo and not queued and min(cold_on) < self.config.max_cold_prefills:
            return 0.0
        return (min(running) + queued / ranks) / rank_rate

    # ---- admission ---------------------------------------------------------------------------
    def admit(self, now: float, gate: Gate | None = None) -> list[Ticket]:
        """Tickets to hand to the engine now, in the order to submit them.

        gate: where each ticket would run and whether the engine's memory there takes it now;
        None = one rank, always fits. A ticket that does not fit holds back the tickets after
        it on the same rank (whoever is first gets memory first); other ranks go on.
        """
        if not self.queue:
            return []
        if self.fifo:
            order = list(self.queue)
        else:
            aging = self.config.aging_s

            def rank(t: Ticket) -> tuple[int, float]:
                warmish = t.cls is RequestClass.WARM or t.aged(now, aging)
                return (0 if warmish else 1, t.arrived_at)

            order = sorted(self.queue, key=rank)
        cold_on = Counter(t.rank for t in self.inflight.values() if t.cls is RequestClass.COLD)
        on_rank = Counter(t.rank for t in self.inflight.values())
        held: set[int] = set()  # ranks whose head did not fit this round
        out: list[Ticket] = []
        taking = 0  # slots handed to new sessions this round
        queued = self._queued_sessions()
        slots_full = False  # new sessions take slots in arrival order
        for t in order:
            # Before the gate: a session waiting for a slot neither places nor holds a rank.
            if t.new_session:
                if t.session_id and self.slots.holds(t.session_id, now):
                    t.new_session = t.needs_slot = False  # another request of it took one
                elif slots_full or not self.slots.has_room(t.prompt_tokens, now, taking, queued):
                    t.needs_slot = slots_full = True
                    continue
            r = gate.place(t) if gate is not None else 0
            if r in held:
                continue
            if not self.fifo and t.cls is RequestClass.WARM:
                self._recheck_warm(t, now, gate)
            if not self.fifo and t.cls is RequestClass.COLD and cold_on[r] >= self.config.max_cold_prefills:
                continue  # the cap; aged cold still waits for a cold slot on its rank
            if gate is not None and not gate.fits(t):
                held.add(r)
                continue
            cold_on[r] += t.cls is RequestClass.COLD
            on_rank[r] += 1
            taking += t.new_session
            out.append(t)
        if out:
            taken = {id(t) for t in out}
            self.queue = [t for t in self.queue if id(t) not in taken]
            for t in out:
                t.admitted_at = now
                t.sharing = on_rank[t.rank]
                self.inflight[t.request_id] = t
                self.waits[t.cls].record(now - t.arrived_at)
                if t.session_id:
                    self._saw(t.session_id, now)
                self.slots.admitted(t.request_id, t.session_id, t.prompt_tokens, now)
                self.slots.num_waited += t.needs_slot
                t.new_session = t.needs_slot = False
        return out

    def _recheck_warm(self, t: Ticket, now: float, gate: Gate | None) -> None:
        """Classify a warm ticket that waited again, from what the engine holds now."""
        uncached = getattr(gate, "uncached", None)
        since = t.arrived_at if t.looked_up_at is None else t.looked_up_at
        if not callable(uncached) or now - since < RECHECK_WARM_S:
            return
        t.looked_up_at = now
        fresh = uncached(t)
        if fresh is not None:
            t.uncached_tokens = fresh
            if fresh > self.config.cold_threshold_tokens:
                t.cls = RequestClass.COLD  # it goes under the cold cap like any cold prefill

    def next_change_s(self, now: float) -> float | None:
        """Seconds until a session waiting for a slot may get one with nothing else happening (an
        idle session's slot frees); None when none waits. A virtual-time server that has nothing
        running wakes then (the live dispatcher re-checks every 50 ms anyway)."""
        if not any(t.needs_slot for t in self.queue):
            return None
        return self.slots.seconds_to_free(now, self._queued_sessions())

    def remove(self, request_id: str) -> Ticket | None:
        """Take a queued ticket out (aborted before admission)."""
        for i, t in enumerate(self.queue):
            if t.request_id == request_id:
                return self.queue.pop(i)
        return None

    # ---- progress ----------------------------------------------------------------------------
    def on_first_token(self, request_id: str, now: float, computed_tokens: int | None = None) -> None:
        t = self.inflight.pop(request_id, None)
        if t is None or t.admitted_at is None:
            return
        tokens = t.uncached_tokens if computed_tokens is None else computed_tokens
        # The sample is its rank's rate (shared by the prefills there); the server has num_ranks.
        self.rate.observe(tokens, now - t.admitted_at, t.sharing * max(1, self.num_ranks))

    def on_done(self, request_id: str, now: float | None = None) -> None:
        """Finished, aborted or failed: forget it if it never produced a first token; its
        session's idle time starts (now; None: from when it was admitted)."""
        self.inflight.pop(request_id, None)
        self.slots.done(request_id, now)

    # ---- truth -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        waiting = {cls: 0 for cls in RequestClass}
        for t in self.queue:
            waiting[t.cls] += 1
        return {
            "policy": self.config.policy,
            "queue_wait": {cls.value: self.waits[cls].to_dict(waiting[cls]) for cls in RequestClass},
            "inflight_prefills": len(self.inflight),
            "inflight_cold_prefills": sum(1 for t in self.inflight.values() if t.cls is RequestClass.COLD),
            "prefill_tokens_per_s": self.rate.tokens_per_s,
            **self.slots.to_dict(),
            "sessions_waiting": sum(1 for t in self.queue if t.needs_slot),
        }


def _limit(config: AdmissionConfig, plan_limit: SessionLimit | None) -> SessionLimit | None:
    """The limit the config asks for: plan's (where the caller knows the hardware), a fixed number,
    or none (0, or the fifo baseline, which has no admission layer)."""
    if config.policy == "fifo" or config.max_active_sessions == 0:
        return None
    if config.max_active_sessions == "plan":
        return plan_limit
    fixed = int(config.max_active_sessions)
    return lambda _context_tokens: fixed
