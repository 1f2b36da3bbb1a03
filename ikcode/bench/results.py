"""What one turn measured, and the summary of a run (the JSON report)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass
class TurnResult:
    agent: int
    conversation: int
    step: int
    sent_at: float  # first attempt, seconds since the run started
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None  # from the first attempt to the first content delta
    finished_at: float | None = None
    attempts: int = 1  # > 1: the turn was shed (529/429) and retried after retry-after
    failed: bool = False
    error: str = ""

    @property
    def cold(self) -> bool:
        """A cold turn: less than half of its prompt came from the cache."""
        return self.cached_tokens * 2 < self.prompt_tokens


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ttft_block(values: list[float]) -> dict[str, float | int]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else 0.0,
        "max": max(values) if values else 0.0,
    }


def _split(ok: list[TurnResult]) -> dict[str, Any]:
    ttft = _ttft_block([t.ttft_s for t in ok if t.ttft_s is not None])
    ttft["warm"] = _ttft_block([t.ttft_s for t in ok if not t.cold and t.ttft_s is not None])
    ttft["cold"] = _ttft_block([t.ttft_s for t in ok if t.cold and t.ttft_s is not None])
    return ttft


def steady_from(turns: list[TurnResult]) -> float | None:
    """When every agent's first turn had finished (None if one never did): turns sent after it
    are the steady state, those before it the start-up burst."""
    first: dict[int, TurnResult] = {}
    for t in turns:
        if t.agent not in first or t.sent_at < first[t.agent].sent_at:
            first[t.agent] = t
    ends = [t.finished_at for t in first.values()]
    if not ends or any(e is None for e in ends):
        return None
    return max(e for e in ends if e is not None)


def summarize(turns: list[TurnResult], duration_s: float, config: dict[str, Any]) -> dict[str, Any]:
    """The bench report: TTFT split warm/cold (all turns, steady state and start-up), failures,
    cache share, read rate, the config."""
    ok = [t for t in turns if not t.failed and t.ttft_s is not None]
    ttft = _split(ok)
    since = steady_from(turns)
    steady = [t for t in ok if since is not None and t.sent_at > since]
    steady_prompt = sum(t.prompt_tokens for t in steady)
    steady_block: dict[str, Any] = {
        "from_s": since,
        "ttft": _split(steady),
        "cached_token_share": sum(t.cached_tokens for t in steady) / steady_prompt if steady_prompt else 0.0,
    }
    startup = [t for t in ok if since is None or t.sent_at <= since]
    prompt = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    within = sum(1 for t in ok if t.ttft_s is not None and t.ttft_s <= 15.0)
    failed = sum(1 for t in turns if t.failed)
    return {
        "config": config,
        "requests": len(turns),
        "completed": len(ok),
        "failed": failed,
        # Why turns failed, the commonest first (a run against a server that is not there says so).
        "errors": dict(Counter(t.error for t in turns if t.failed and t.error).most_common(3)),
        "shed_retries": sum(t.attempts - 1 for t in turns),
        "ttft": ttft,
        "steady": steady_block,
        "startup": {"ttft": _split(startup)},
        # Of the turns answered or failed: a failed turn was not answered within 15 s.
        "share_within_15s": within / (len(ok) + failed) if ok or failed else 0.0,
        "cached_token_share": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "computed_tokens": prompt - cached,
        "output_tokens": sum(t.output_tokens for t in ok),
        "duration_s": duration_s,
        "read_tokens_per_s": prompt / duration_s if duration_s > 0 else 0.0,
        "computed_tokens_per_s": (prompt - cached) / duration_s if duration_s > 0 else 0.0,
    }
