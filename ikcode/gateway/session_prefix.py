"""How much of a request's prompt repeats the previous prompt of the same conversation.

The request log carries this beside the cache figures so that a reader can tell "the rendered
prefix changed" (few shared tokens: a changing system line, a re-rendered turn) from "the prefix
was the same but the cache missed" (many shared tokens, few cached: a silent miss or eviction).
Only the latest prompt of each session is kept (a reference to its token list, no copy), in an
LRU bounded by tokens.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass

# Slices of this many tokens are copied to compare (0.25 MB of pointers): few Python steps for a
# 450K-token prompt, little copying to find where two prompts part.
_CHUNK_TOKENS = 32_768


@dataclass(frozen=True)
class SharedPrefix:
    shared_tokens: int  # leading tokens equal to the session's previous prompt
    previous_tokens: int  # length of that previous prompt
    segment: int | None  # index of the segment where the two diverge (0 = system + tools); None: no break


def common_prefix(
    a: list[int], b: list[int], boundaries: list[int], known_tokens: int = 0
) -> tuple[int, int | None]:
    """Length of the common prefix and the index of the segment it ends in (None if a or b ends).
    known_tokens: a prefix length the caller knows to be equal (not compared again).

    Compared in chunks of C-speed slice equality (a warm turn usually repeats the whole previous
    prompt: one pass), then bisected inside the first chunk that differs."""
    limit = min(len(a), len(b))
    for start in range(min(known_tokens, limit), limit, _CHUNK_TOKENS):
        end = min(start + _CHUNK_TOKENS, limit)
        if a[start:end] != b[start:end]:
            lo, hi = start, end  # a[:lo] == b[:lo], a[:hi] != b[:hi]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if a[lo:mid] == b[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            return lo, bisect_right(boundaries, lo)
    return limit, None


class SessionPrefixes:
    def __init__(self, max_tokens: int = 4_000_000, max_sessions: int = 4096):
        self.max_tokens = max_tokens
        self.max_sessions = max_sessions
        self._prompts: OrderedDict[str, list[int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def observe(
        self,
        session_id: str | None,
        token_ids: list[int],
        boundaries: list[int],
        copied_from: tuple[list[int], int] | None = None,
    ) -> SharedPrefix | None:
        """Compare with the session's previous prompt, then remember this one. None: no session.

        copied_from: (a prompt, n) when token_ids begins with a copy of that prompt's first n
        tokens (the renderer reused a previous render): if it is the session's previous prompt,
        only what follows is compared (a few thousand tokens instead of 450K)."""
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
        known = copied_from[1] if copied_from is not None and copied_from[0] is previous else 0
        shared, segment = common_prefix(previous, token_ids, boundaries, known)
        if shared == len(previous):
            segment = None
        return SharedPrefix(shared, len(previous), segment)
