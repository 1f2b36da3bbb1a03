"""Placement: where an engine with several ranks would run a request, and what it would take there.

An engine whose KV memory and compute are split over ranks (one data-parallel process per card)
may offer two optional methods, read by admission (ikcode.admission.gate):

    rank_loads() -> list[EngineLoad]    one per rank; kv_blocks_total counts the blocks sequences
                                        may be given there (less any reserve the engine keeps free)
    placement(request, admitting) -> Placement
                                        the rank the engine would route the request to now, with
                                        admitting[r] more requests on rank r (handed in this
                                        round, not yet submitted), and the KV blocks its
                                        allocation takes out of that rank's free pool (whole
                                        prompt, copies of cache hits included). No side effects.

An engine without them is one rank whose load() is the whole engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Placement:
    rank: int
    kv_blocks: int  # blocks the allocation takes from the rank's free (or evictable) pool


def engine_kv_tokens(engine: Any) -> int:
    """Tokens the engine's KV memory can give sequences, all ranks together (0 for an engine
    that does not say, such as an upstream endpoint)."""
    rank_loads = getattr(engine, "rank_loads", None)
    loads = rank_loads() if callable(rank_loads) else [engine.load()]
    return sum(load.kv_blocks_total for load in loads) * max(1, engine.info.block_size)
