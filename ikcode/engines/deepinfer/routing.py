"""Which rank serves a request: session affinity across data-parallel ranks, with a load guard.

The GPU tier is per rank (facts: Several GPUs), so a conversation must come back to the rank that
holds its prefix: first by X-Claude-Code-Session-Id (EngineRequest.session_id), then by the rank
whose cache holds the longest prefix of the prompt, else the least loaded rank (ties: the one with
the fewest sessions, so new conversations spread over the ranks). A rank with more than
`max_imbalance` requests queued for their prefill beyond the least queued one is passed over (a
cold prefill elsewhere beats a long queue).

The load is the rank's queue, requests submitted that have not produced their first token, not
every request it runs: a decoding request does not delay a new one's prefill, while leaving the
rank that holds a conversation reads the whole conversation again on another rank (at 450K
tokens, ~9 s of one card), and the engine prefills first come first served, so every request
queued behind that read waits for it too. Counted with the decoding ones, ordinary swings of
25-35 requests per rank moved conversations (bench/simulate_trace.py: "later turns recomputed").

A count says nothing of size either: nine warm tails of 2K tokens queued behind one cold read is
a long queue by count and ~10 s of one card's prefill, and leaving for a rank without the
conversation reads it whole again there (another ~10 s, and a wall for that rank's queue). So a
caller that knows the work (`work(rank)`: blocks of prefill queued there plus this prompt's
blocks not cached there) keeps a session on its rank whenever no other rank would get through
that sooner; the count guard only moves it when another rank would.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable


class SessionRouter:
    def __init__(self, num_ranks: int, max_imbalance: int, max_sessions: int = 100_000):
        self.num_ranks = num_ranks
        self.max_imbalance = max_imbalance
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._per_rank = [0] * num_ranks  # sessions routed to each rank
        self._lock = threading.Lock()

    def route(
        self,
        session_id: str | None,
        cached_blocks: Callable[[int], int],
        load: Callable[[int], int],
        work: Callable[[int], int] | None = None,
    ) -> int:
        """cached_blocks(rank): blocks of this prompt cached on rank; load(rank): its requests
        waiting for their prefill; work(rank): blocks of prefill this request would wait behind
        and compute there (None: not known). The choice is remembered for the session."""
        loads = [load(r) for r in range(self.num_ranks)]
        works = [work(r) for r in range(self.num_ranks)] if work is not None else None
        with self._lock:
            known = self._sessions.get(session_id) if session_id else None
            choice = self._choose(known, cached_blocks, loads, works)
            if session_id and choice != known:
                if known is not None:
                    self._per_rank[known] -= 1
                self._per_rank[choice] += 1
                self._sessions[session_id] = choice
            if session_id:
                self._sessions.move_to_end(session_id)
                while len(self._sessions) > self.max_sessions:
                    self._per_rank[self._sessions.popitem(last=False)[1]] -= 1
        return choice

    def peek(
        self,
        session_id: str | None,
        cached_blocks: Callable[[int], int],
        load: Callable[[int], int],
        work: Callable[[int], int] | None = None,
    ) -> int:
        """The rank route() would pick now, leaving the router as it is (admission asks where a
        request would go before it is submitted, and may not submit it)."""
        loads = [load(r) for r in range(self.num_ranks)]
        works = [work(r) for r in range(self.num_ranks)] if work is not None else None
        with self._lock:
            known = self._sessions.get(session_id) if session_id else None
            return self._choose(known, cached_blocks, loads, works)

    def _choose(
        self,
        known: int | None,
        cached_blocks: Callable[[int], int],
        loads: list[int],
        works: list[int] | None = None,
    ) -> int:
        least = min(loads)
        fits = [r for r in range(self.num_ranks) if loads[r] - least <= self.max_imbalance]
        if known is not None and (known in fits or (works is not None and works[known] <= min(works))):
            return known
        held = {r: cached_blocks(r) for r in fits}
        best = max(held.values(), default=0)
        candidates = [r for r in fits if held[r] == best] if best else fits
        return min(candidates, key=lambda r: (loads[r], self._per_rank[r], r))
