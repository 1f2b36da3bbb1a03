"""A rank that stops answering: a step that never returns (a collective waiting for a peer that
hangs, a kernel that never ends) leaves the rank's process alive and its pipe open, so nothing
else notices. Its streams would wait forever and every RPC to it time out one by one.

Each rank loop says it is alive between steps (`beat_interval_s`), and is watched from its
first beat on (after its start, its host tier's pinning, its first step); a rank silent for
`silent_s` is then taken as dead: the engine's rank-death path fails its requests, stops every rank
and refuses new work with the reason, as for a rank that exited.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


def beat_interval_s(silent_s: float) -> float:
    """How often a rank says it is alive: four beats at least within the silence allowed."""
    return min(1.0, silent_s / 4)


class RankWatchdog:
    def __init__(
        self,
        silent_s: float,
        ranks: Sequence[Any],  # each with .rank and .heard_at (monotonic time of its last message or None)
        on_hung: Callable[[Any, str], None],
        stopped: Callable[[], bool],
    ):
        self.silent_s, self.ranks, self.on_hung, self.stopped = silent_s, ranks, on_hung, stopped
        self._thread = threading.Thread(target=self._watch, name="ikcode-deepinfer-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        while not self.stopped():
            time.sleep(beat_interval_s(self.silent_s))
            now = time.monotonic()
            silent = [r for r in self.ranks if r.heard_at is not None and now - r.heard_at > self.silent_s]
            if silent and not self.stopped():
                names = ", ".join(str(r.rank) for r in silent)
                self.on_hung(
                    silent[0],
                    f"rank {names} sent nothing for {self.silent_s:g} s (hung in a step; hung_rank_s)",
                )
                return
