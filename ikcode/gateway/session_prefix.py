"""How much of a request's prompt repeats the previous prompt of the same conversation.

The request log carries this beside the cache figures so that a reader can tell "the rendered
prefix changed" (few shared tokens: a changing system line, a re-rendered turn) from "the prefix
was the same but the cache missed" (many shared tokens, few cached: a silent miss or eviction).
Only the latest prompt of each session is kept (a reference to its token list, no copy), in an
LRU bounded by tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class SharedPrefix:
    shared_tokens: int  # leading tokens equal to the session's previous prompt
    previous_tokens: int  # length of that previous prompt
    segment: int | None  # index of the segment where the two diverge (0 = system + tools); None: no break


def common_prefix(a: list[int], b: list[int], boundaries: list[int]) -> tuple[int, int | None]:
    """Length of the common prefix and the index of the segment it ends in (None if a or b ends).

    Compared segment by segment (C-speed slice equality), then bisected inside the first segment
    that differs, so a long conversation costs one pass."""
    limit = min(len(a), len(b))
    start = 0
    for index, end in enumerate([*(e for e in boundaries if e < limit), limit]):
        if a[start:end] != b[start:end]:
            lo, hi = start, end  # a[:lo] == b[:lo], a[:hi] != b[:hi]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if a[lo:mid] == b[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            return lo, index
        start = end
    return limit, None


class SessionPrefixes:
    def __init__(self, max_tokens: int = 4_000_000, max_sessions: int = 4096):
        self.max_tokens = max_tokens
        self.max_sessions = max_sessions
        self._prompts: OrderedDict[str, list[int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def observe(
        self, session_id: str | None, token_ids: list[int], boundaries: list[int]
    ) -> SharedPrefix | None:
        """Compare with the session's previous prompt, then remember this one. None: no session."""
        if not session_id:
            return None
        with self._lock:
            previous = self._prompts.pop(session_id, None)
            if previous is not None:
                self._tokens -= len(previous)
            self._prompts[session_id] = token_ids
            self._tokens += len(token_ids)
            while len(self._prompts) > 1 and (
                self._tokens > self.max_tokens or len(self._prompts) > self.max_sessions
            ):
                _, dropped = self._prompts.popitem(last=False)
                self._tokens -= len(dropped)
        if previous is None:
            return None
        shared, segment = common_prefix(previous, token_ids, boundaries)
        if shared == len(previous):
            segment = None
        return SharedPrefix(shared, len(previous), segment)
