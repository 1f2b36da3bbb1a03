"""Reference hit ratios for a block-key trace: the infinite cache and Belady's optimal eviction.

Both take requests as lists of chained block keys (a key implies its whole prefix) and count a
request's hit as its longest cached prefix, as PrefixCache does. They are the ceilings a real
policy is judged against, computed over the same requests in the same run.

One difference, kept on purpose: a request's last block may hit here, as in the published
Mooncake replay figures these reproduce (tests/test_cache_trace_replay.py), while PrefixCache
always recomputes the block holding the prompt's last token. A repeat of a block-aligned prompt
is therefore one block short of the bounds whatever the policy.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

Key = Hashable
_NEVER = float("inf")


def infinite_hits(requests: Sequence[Sequence[Key]]) -> list[int]:
    """Hit blocks per request when nothing is ever evicted."""
    seen: set[Key] = set()
    hits: list[int] = []
    for keys in requests:
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hits.append(n)
        seen.update(keys)
    return hits


def belady_hits(requests: Sequence[Sequence[Key]], capacity_blocks: int) -> list[int]:
    """Hit blocks per request with Belady's eviction: after each request, while over capacity,
    drop the block whose next use is farthest (never used again first; deeper blocks first on
    ties, so a parent never goes before its child and no orphan wastes space).

    A max-heap with lazy deletion keeps it O(B log B) for B block occurrences.
    """
    # Next request index that uses each key occurrence, from a backward pass.
    next_use: list[list[float]] = [[] for _ in requests]
    last: dict[Key, float] = {}
    for r in range(len(requests) - 1, -1, -1):
        keys = requests[r]
        next_use[r] = [last.get(k, _NEVER) for k in keys]
        for k in keys:
            last[k] = r
    cached: dict[Key, float] = {}  # key -> its current next use
    heap: list[tuple[float, int, int, Key]] = []  # (-next_use, -depth, tiebreak, key)
    hits: list[int] = []
    tiebreak = 0
    for r, keys in enumerate(requests):
        n = 0
        while n < len(keys) and keys[n] in cached:
            n += 1
        hits.append(n)
        for depth, (k, nu) in enumerate(zip(keys, next_use[r], strict=True)):
            if nu == _NEVER:
                cached.pop(k, None)  # not needed again: keeping it can only cost room
                continue
            cached[k] = nu
            tiebreak += 1
            heapq.heappush(heap, (-nu, -depth, tiebreak, k))
        while len(cached) > capacity_blocks:
            neg_nu, _, _, k = heapq.heappop(heap)
            if cached.get(k) == -neg_nu:
                del cached[k]
        if len(heap) > 4 * max(capacity_blocks, len(cached)) + 1024:  # drop stale entries
            heap = [e for e in heap if cached.get(e[3]) == -e[0]]
            heapq.heapify(heap)
    return hits
