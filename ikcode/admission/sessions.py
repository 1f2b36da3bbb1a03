"""SessionSlots: how many sessions are active at once, against the limit `ikcode plan` computes.

A server carries a number of agents of a given conversation size (ikcode.plan: GPU memory for the
turns in flight, compute for the tokens each agent reads per cycle, a new conversation's cold read
included). Past that number every turn of every session waits (a closed system: N agents on a
server that serves K answer in about N / K cycles), so admission keeps the sessions in progress
under it and a new session waits for a slot instead.

A session takes a slot with its first admitted request and holds it while any request of it is
in flight and for `idle_s` after its last one ended (an agent's tool runs between its turns; a
session that stops sending has ended: the server gets no other sign of it). A session that held a
slot and comes back after that gets one again at once, over the limit if need be: its turns were
counted in the limit all along, and the slot it left went to a new session. Requests without a
session id are a session each, held while in flight.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TypeVar

SessionLimit = Callable[[int], int]  # conversation tokens at its first turn -> sessions at once
# Session ids come from a client header: what is remembered per session is bounded in count too.
MAX_SESSIONS = 10_000
V = TypeVar("V")


def forget_least_recent(
    entries: OrderedDict[str, V], now: float, last_seen: Callable[[V], float], max_age_s: float
) -> list[tuple[str, V]]:
    """Drop, least recently seen first, the entries idle past max_age_s and any past MAX_SESSIONS
    (entries is kept in the order last seen); returns what was dropped."""
    dropped: list[tuple[str, V]] = []
    while entries:
        key, value = next(iter(entries.items()))
        if now - last_seen(value) <= max_age_s and len(entries) <= MAX_SESSIONS:
            break
        del entries[key]
        dropped.append((key, value))
    return dropped


@dataclass
class _Slot:
    first_prompt_tokens: int  # the conversation's size when it started (plan's context)
    last_at: float  # its last request admitted or ended
    inflight: int = 0  # its requests admitted and not yet done


class SessionSlots:
    def __init__(self, limit: SessionLimit | None, idle_s: float, memory_s: float):
        self.limit = limit
        self.idle_s = idle_s
        self.memory_s = memory_s  # a session seen this recently gets its slot back at once
        self._active: dict[str, _Slot] = {}
        self._left: dict[str, _Slot] = {}  # released slots (last_at: when), for a return
        self._requests: dict[str, str] = {}  # admitted request id -> its session key
        self.num_waited = 0  # new sessions that got a slot after waiting for one

    @property
    def enabled(self) -> bool:
        return self.limit is not None

    def num_active(self) -> int:
        return len(self._active)

    def holds(self, session: str, now: float) -> bool:
        """Whether session may run now without a new slot: it has one, or it had one lately."""
        if session in self._active:
            return True
        left = self._left.get(session)
        return left is not None and now - left.last_at <= self.memory_s

    def max_active(self, candidate_tokens: int | None = None) -> int | None:
        """Plan's limit at the mean size of the conversations in progress (and the candidate's);
        None without a limit or a conversation to size it by."""
        sizes = [s.first_prompt_tokens for s in self._active.values()]
        if candidate_tokens is not None:
            sizes.append(candidate_tokens)
        if self.limit is None or not sizes:
            return None
        return max(1, self.limit(sum(sizes) // len(sizes)))

    def has_room(
        self, candidate_tokens: int, now: float, taking: int = 0, queued: Collection[str | None] = ()
    ) -> bool:
        """Whether a new session of this size gets a slot now (`taking`: slots handed out in this
        admission round that are not taken yet; `queued`: sessions with a request waiting in
        admission, which are not idle)."""
        limit = self.max_active(candidate_tokens)
        if limit is None:
            return True
        if len(self._active) + taking >= limit:
            self.release_idle(now, queued)
            limit = self.max_active(candidate_tokens) or limit
        return len(self._active) + taking < limit

    def seconds_to_free(self, now: float, queued: Collection[str | None] = ()) -> float | None:
        """When the first slot frees as things stand (a session idle now reaching idle_s); None
        when every session has a request in flight or waiting."""
        idle = [
            s.last_at + self.idle_s - now
            for key, s in self._active.items()
            if s.inflight == 0 and key not in queued
        ]
        return max(0.0, min(idle)) if idle else None

    def admitted(self, request_id: str, session: str | None, prompt_tokens: int, now: float) -> None:
        if self.limit is None:
            return  # nothing to count against
        key = session or f"request:{request_id}"
        slot = self._active.get(key)
        if slot is None:
            left = self._left.pop(key, None)  # a session back keeps its conversation's first size
            slot = self._active[key] = _Slot(left.first_prompt_tokens if left else prompt_tokens, now)
        slot.inflight += 1
        slot.last_at = now
        self._requests[request_id] = key

    def done(self, request_id: str, now: float | None) -> None:
        key = self._requests.pop(request_id, None)
        slot = self._active.get(key) if key is not None else None
        if slot is None or key is None:
            return
        slot.inflight -= 1
        if now is not None:
            slot.last_at = max(slot.last_at, now)
        if slot.inflight == 0 and key.startswith("request:"):
            del self._active[key]  # nothing can come back under a request's own id

    def release_idle(self, now: float, queued: Collection[str | None] = ()) -> None:
        """Free the slots of sessions idle for idle_s: nothing in flight, nothing queued (a turn
        waiting in admission is the session at work, however long it waits)."""
        for key, slot in list(self._active.items()):
            if slot.inflight == 0 and now - slot.last_at >= self.idle_s and key not in queued:
                self._left[key] = self._active.pop(key)
                slot.last_at = now
        if len(self._left) > 4 * len(self._active) + 1024:
            self._left = {k: s for k, s in self._left.items() if now - s.last_at <= self.memory_s}

    def to_dict(self) -> dict[str, int | None]:
        return {
            "active_sessions": len(self._active),
            "max_active_sessions": self.max_active(),
            "sessions_waited": self.num_waited,
        }
