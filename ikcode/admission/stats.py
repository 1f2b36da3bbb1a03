"""Queue wait by request class (warm/cold): the metric nobody exposes, exposed."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class ClassWaits:
    admitted: int = 0
    shed: int = 0
    total_wait_s: float = 0.0
    max_wait_s: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=4096))

    def record(self, wait_s: float) -> None:
        self.admitted += 1
        self.total_wait_s += wait_s
        self.max_wait_s = max(self.max_wait_s, wait_s)
        self.recent.append(wait_s)

    def to_dict(self, waiting: int) -> dict[str, float | int]:
        ordered = sorted(self.recent)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

        return {
            "waiting": waiting,
            "admitted": self.admitted,
            "shed": self.shed,
            "mean_wait_s": self.total_wait_s / self.admitted if self.admitted else 0.0,
            "p50_wait_s": pct(0.50),
            "p95_wait_s": pct(0.95),
            "max_wait_s": self.max_wait_s,
        }
