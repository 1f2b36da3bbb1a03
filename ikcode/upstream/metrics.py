"""Prometheus metrics of the upstream front, and the request-log record they share.

Two kinds of truth, kept apart by name: what ikcode measures itself (TTFT, durations, which
replica served) and what the upstream reports (prompt, cached and output tokens). An upstream
that does not report its cache is counted as such, never as a miss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ikcode.gateway.metrics import WARM_HIT_RATE, request_outcomes

MEASURED = "measured_by_ikcode"
REPORTED = "reported_by_upstream"
NOT_REPORTED = "not_reported_by_upstream"
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300)


class _ReplicaCollector(Collector):
    def __init__(self, snapshot: Callable[[], list[dict[str, Any]]]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rows = self.snapshot()
        for key in ("healthy", "in_flight", "served", "sessions", "failures"):
            family = GaugeMetricFamily(
                f"ikcode_replica_{key}", f"replica {key.replace('_', ' ')}", labels=["replica", "url"]
            )
            for row in rows:
                family.add_metric([row["replica"], row["url"]], float(row[key]))
            yield family


class UpstreamMetrics:
    def __init__(self, snapshot: Callable[[], list[dict[str, Any]]]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ikcode_requests", "requests answered", ["route", "status"], registry=r)
        self.ttft = Histogram(
            "ikcode_ttft_seconds",
            "time to first token from arrival at ikcode, measured by ikcode",
            ["cache"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "ikcode_upstream_prompt_tokens", "prompt tokens, reported by upstream", registry=r
        )
        self.cached_tokens = Counter(
            "ikcode_upstream_cached_tokens", "prompt tokens read from cache, reported by upstream", registry=r
        )
        self.cache_unreported = Counter(
            "ikcode_upstream_cache_unreported", "answers whose upstream did not report its cache", registry=r
        )
        self.generated_tokens = Counter(
            "ikcode_generated_tokens", "generated tokens, reported by upstream", registry=r
        )
        self.retries = Counter(
            "ikcode_upstream_retries", "connection-level retries on another replica", registry=r
        )
        self.in_flight = Gauge("ikcode_requests_in_flight", "requests being answered", registry=r)
        r.register(_ReplicaCollector(snapshot))

    def observe(self, record: dict[str, Any]) -> None:
        """Account one finished request from its request-log record."""
        prompt, cached = record.get("prompt_tokens") or 0, record.get("cached_tokens")
        self.prompt_tokens.inc(prompt)
        self.generated_tokens.inc(record.get("output_tokens") or 0)
        if record.get("cache_source") == REPORTED:
            self.cached_tokens.inc(cached or 0)
        elif prompt:
            self.cache_unreported.inc()
        ttft_ms = record.get("ttft_ms")
        if ttft_ms is not None:
            self.ttft.labels(record.get("cache_class") or "unknown").observe(ttft_ms / 1000)

    def totals(self) -> dict[str, Any]:
        get = self.registry.get_sample_value
        prompt = get("ikcode_upstream_prompt_tokens_total") or 0.0
        cached = get("ikcode_upstream_cached_tokens_total") or 0.0
        return {
            **request_outcomes(self.requests),
            "prompt_tokens": int(prompt),
            "cached_tokens_reported_by_upstream": int(cached),
            "answers_without_cache_report": int(get("ikcode_upstream_cache_unreported_total") or 0),
            "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "hit_rate_source": REPORTED,
            "ttft_source": MEASURED,
            "generated_tokens": int(get("ikcode_generated_tokens_total") or 0),
        }


def finish_record(record: dict[str, Any], prompt: int, cached: int | None, output: int) -> None:
    """Usage fields of a request-log record, each marked with where it came from."""
    record.update(
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=output,
        cache_source=REPORTED if cached is not None else NOT_REPORTED,
        hit_rate=round((cached or 0) / prompt, 4) if prompt and cached is not None else None,
        ttft_source=MEASURED,
    )
    if cached is not None and prompt:
        record["cache_class"] = "warm" if cached / prompt >= WARM_HIT_RATE else "cold"
