"""Prometheus metrics of one gateway, in a registry of its own (several apps per process in tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ikcode.engines.base import Engine, RequestStats

WARM_HIT_RATE = 0.5  # a request that found at least half its prompt cached counts as warm
_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)

# The per-user families: only the server's own token sees them (app.py, /health and /metrics).
PER_USER = b"ikcode_user_"


def request_outcomes(requests: Counter) -> dict[str, int]:
    """/v1/messages requests by outcome, from a Counter labelled (route, status): answered
    (`requests`, 2xx), `errors` (the server's: 5xx, 529 overloaded) and `refused` (4xx: the
    request's own fault, or its client left), for /health and `ikcode status`."""
    out = {"requests": 0.0, "errors": 0.0, "refused": 0.0}
    for metric in requests.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels.get("route") == "/v1/messages":
                kind = sample.labels.get("status", "")[:1]
                out["requests" if kind == "2" else "refused" if kind == "4" else "errors"] += sample.value
    return {key: int(value) for key, value in out.items()}


def _flatten(prefix: str, data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(f"{prefix}_{key}", value))
    return out


class _LiveCollector(Collector):
    """Engine load and cache statistics, read at scrape time."""

    def __init__(self, engine: Engine, extra: Callable[[], dict[str, Any]]):
        self.engine = engine
        self.extra = extra

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            load = self.engine.load()
        except Exception:  # an engine that cannot answer must not break the scrape
            return
        for name in (
            "running",
            "waiting",
            "kv_blocks_total",
            "kv_blocks_used",
            "kv_blocks_cached",
            "host_blocks_total",
            "host_blocks_used",
        ):
            yield GaugeMetricFamily(
                f"ikcode_engine_{name}", f"engine {name.replace('_', ' ')}", value=getattr(load, name)
            )
        yield from self._rank_gauges()
        stats: dict[str, Any] = {}
        # An engine may expose its cache counters: `cache_stats()` or a `cache.snapshot()`.
        cache_stats = getattr(self.engine, "cache_stats", None)
        if not callable(cache_stats):
            cache_stats = getattr(getattr(self.engine, "cache", None), "snapshot", None)
        if callable(cache_stats):
            try:
                stats.update({f"cache_{k}": v for k, v in dict(cache_stats()).items()})
            except Exception:
                pass
        admission_stats = getattr(self.engine, "admission_stats", None)
        if callable(admission_stats):
            try:
                stats.update(_flatten("admission", admission_stats()))
            except Exception:
                pass
        stats.update(self.extra())
        for key, value in stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                yield GaugeMetricFamily(f"ikcode_{key}", key.replace("_", " "), value=value)

    def _rank_gauges(self) -> Iterator[GaugeMetricFamily]:
        """The blocks each rank can give a sequence: a conversation lives on one rank, so what
        fits is decided rank by rank, not by the sum (`ikcode doctor`'s capacity check)."""
        rank_loads = getattr(self.engine, "rank_loads", None)
        if not callable(rank_loads):
            return
        try:
            loads = rank_loads()
        except Exception:
            return
        family = GaugeMetricFamily(
            "ikcode_engine_rank_kv_blocks_total",
            "KV blocks a sequence can be given, per rank",
            labels=["rank"],
        )
        for rank, load in enumerate(loads):
            family.add_metric([str(rank)], load.kv_blocks_total)
        yield family


class GatewayMetrics:
    def __init__(self, engine: Engine, extra: Callable[[], dict[str, Any]] = dict):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ikcode_requests", "requests answered", ["route", "status"], registry=r)
        self.ttft = Histogram(
            "ikcode_ttft_seconds",
            "time to first token, from arrival",
            ["cache"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "ikcode_queue_wait_seconds",
            "time queued before the engine allocated it (admission and engine)",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("ikcode_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "ikcode_cached_tokens", "prompt tokens served from cache", ["tier"], registry=r
        )
        self.generated_tokens = Counter("ikcode_generated_tokens", "generated tokens", registry=r)
        self.in_flight = Gauge("ikcode_requests_in_flight", "requests being answered", registry=r)
        # Claude Code's compaction (summary) requests: a cold read of a whole conversation each.
        self.compactions = Counter("ikcode_compactions", "compaction (summary) requests answered", registry=r)
        self.compaction_tokens = Counter(
            "ikcode_compaction_tokens", "tokens of compaction requests", ["kind"], registry=r
        )
        self.last_compaction: dict[str, Any] = {}
        # Per user (auth token name): with salting on, each user's hit rate is their own cache's.
        self.user_prompt_tokens = Counter(
            PER_USER.decode() + "prompt_tokens", "prompt tokens by user", ["user"], registry=r
        )
        self.user_cached_tokens = Counter(
            PER_USER.decode() + "cached_tokens", "prompt tokens from cache by user", ["user"], registry=r
        )
        self._own = (self.prompt_tokens, self.cached_tokens, self.generated_tokens)
        self._own += (self.compactions, self.compaction_tokens)
        r.register(_LiveCollector(engine, extra))

    def totals(self) -> dict[str, float]:
        """Running totals for /health and `ikcode status`: read from the gateway's own metrics,
        not the registry, whose scrape also asks the engine (a DeepInfer rank answers between
        its steps, seconds apart under a long prefill: /health must not wait for that)."""
        get = self._own_sample
        prompt = get("ikcode_prompt_tokens_total") or 0.0
        device = get("ikcode_cached_tokens_total", {"tier": "device"}) or 0.0
        host = get("ikcode_cached_tokens_total", {"tier": "host"}) or 0.0
        return {
            **request_outcomes(self.requests),
            "prompt_tokens": int(prompt),
            "cached_tokens_device": int(device),
            "cached_tokens_host": int(host),
            "hit_rate": round((device + host) / prompt, 4) if prompt else 0.0,
            "generated_tokens": int(get("ikcode_generated_tokens_total") or 0),
            **self._compaction_totals(),
        }

    def _own_sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """registry.get_sample_value(name, labels) over this gateway's own metrics only."""
        for metric in self._own:
            for family in metric.collect():
                for sample in family.samples:
                    if sample.name == name and sample.labels == (labels or {}):
                        return sample.value
        return None

    def _compaction_totals(self) -> dict[str, Any]:
        get = self._own_sample
        out: dict[str, Any] = {"compactions": int(get("ikcode_compactions_total") or 0)}
        for kind in ("prompt", "cached", "output"):
            value = get("ikcode_compaction_tokens_total", {"kind": kind})
            out[f"compaction_{kind}_tokens"] = int(value or 0)
        out.update({f"last_compaction_{k}": v for k, v in self.last_compaction.items()})
        return out

    def observe_compaction(
        self, stats: RequestStats | None, ttft_s: float | None, output_tokens: int
    ) -> None:
        self.compactions.inc()
        self.compaction_tokens.labels("output").inc(output_tokens)
        prompt = stats.prompt_tokens if stats else 0
        cached = stats.cached_tokens if stats else 0
        self.compaction_tokens.labels("prompt").inc(prompt)
        self.compaction_tokens.labels("cached").inc(cached)
        self.last_compaction = {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "output_tokens": output_tokens,
            "ttft_ms": None if ttft_s is None else round(ttft_s * 1000, 2),
        }

    def by_user(self) -> dict[str, dict[str, float]]:
        """Prompt and cached tokens and the hit rate of each user (authenticated /health)."""
        out: dict[str, dict[str, float]] = {}
        for counter, key in (
            (self.user_prompt_tokens, "prompt_tokens"),
            (self.user_cached_tokens, "cached_tokens"),
        ):
            for metric in counter.collect():
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        out.setdefault(sample.labels["user"], {})[key] = int(sample.value)
        for figures in out.values():
            prompt = figures.get("prompt_tokens", 0)
            figures["hit_rate"] = round(figures.get("cached_tokens", 0) / prompt, 4) if prompt else 0.0
        return out

    def observe_generation(
        self,
        stats: RequestStats | None,
        ttft_s: float | None,
        queue_wait_s: float | None,
        output_tokens: int,
        user: str | None = None,
    ) -> None:
        self.generated_tokens.inc(output_tokens)
        if stats is None:
            return
        if user is not None:
            self.user_prompt_tokens.labels(user).inc(stats.prompt_tokens)
            self.user_cached_tokens.labels(user).inc(stats.cached_tokens_device + stats.cached_tokens_host)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.labels("device").inc(stats.cached_tokens_device)
        self.cached_tokens.labels("host").inc(stats.cached_tokens_host)
        if ttft_s is not None:
            self.ttft.labels("warm" if stats.hit_rate >= WARM_HIT_RATE else "cold").observe(ttft_s)
        if queue_wait_s is not None:
            self.queue_wait.observe(queue_wait_s)
