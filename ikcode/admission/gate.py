"""RankGate: for one admission round, which rank each ticket would run on and whether it fits there.

A data-parallel engine has one KV memory per rank and a request runs on one rank: a cold cap or
a memory check over the pooled engine would admit work no rank can take, or leave ranks idle. The
gate asks the engine (optional methods, see ikcode.engines.placement) where a request would go and
how many blocks its allocation takes; an engine that does not say is one rank, and its allocation
is the whole prompt (cached blocks that nobody runs are in the free pool until a sequence takes
them, so a hit leaves the pool too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ikcode.engines.base import EngineLoad
from ikcode.engines.placement import Placement

from .policy import Ticket


def num_ranks(engine: Any) -> int:
    rank_loads = getattr(engine, "rank_loads", None)
    return len(rank_loads()) if callable(rank_loads) else 1


class RankGate:
    """Read the engine's per-rank memory once per round; blocks promised to requests that have
    not allocated yet count against their rank: those of earlier rounds still waiting for the
    engine's next step (`promised`, which its load does not show), and those of this round."""

    def __init__(self, engine: Any, memory_gate: bool = True, promised: Mapping[int, int] | None = None):
        self.engine = engine
        self.memory_gate = memory_gate
        self._loads: list[EngineLoad] | None = None
        self._promised: dict[int, int] = dict(promised or {})
        self._needs: dict[str, int] = {}
        self._admitting: list[int] = [0] * num_ranks(engine)  # handed in this round, per rank

    def place(self, ticket: Ticket) -> int:
        """The rank the engine would run this ticket on (sets ticket.rank)."""
        placement = getattr(self.engine, "placement", None)
        if callable(placement) and ticket.payload is not None:
            where: Placement = placement(ticket.payload, self._admitting)
        else:
            block_size = max(1, self.engine.info.block_size)
            where = Placement(0, -(-ticket.prompt_tokens // block_size))
        ticket.rank = where.rank
        self._needs[ticket.request_id] = where.kv_blocks
        return where.rank

    def uncached(self, ticket: Ticket) -> int | None:
        """Tokens the engine would compute for the ticket now (its cache looked up again): the
        engine's own answer where it gives one (the simulated server's requests carry no token
        ids), else a lookup of the request's prompt."""
        own = getattr(self.engine, "uncached_tokens", None)
        if callable(own) and ticket.payload is not None:
            return own(ticket.payload)
        request = ticket.payload
        lookup = getattr(self.engine, "lookup", None)
        if request is None or not callable(lookup) or not hasattr(request, "prompt_token_ids"):
            return None
        return lookup(request.prompt_token_ids, request.cache_salt, request.block_hashes).uncached_tokens

    def blocks_for(self, ticket: Ticket) -> int:
        """The blocks ticket's allocation takes on its rank (after `place`)."""
        return self._needs.get(ticket.request_id, 0)

    def fits(self, ticket: Ticket) -> bool:
        """Whether ticket's allocation fits its rank's free blocks now; if so they are promised
        (the policy admits what fits)."""
        if not self.memory_gate:
            self._admitting[ticket.rank] += 1
            return True
        if self._loads is None:
            rank_loads = getattr(self.engine, "rank_loads", None)
            self._loads = rank_loads() if callable(rank_loads) else [self.engine.load()]
        load = self._loads[ticket.rank]
        if load.kv_blocks_total <= 0:
            self._admitting[ticket.rank] += 1
            return True  # the engine does not say: let it queue
        need = self._needs.get(ticket.request_id, 0)
        promised = self._promised.get(ticket.rank, 0)
        free = load.kv_blocks_total - load.kv_blocks_used - promised
        # An idle rank takes whatever comes: the engine then runs it or fails it, never waits.
        if need <= free or (load.running == 0 and promised == 0):
            self._promised[ticket.rank] = promised + need
            self._admitting[ticket.rank] += 1
            return True
        return False
