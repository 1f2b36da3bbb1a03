"""Cumulative cache truth: what was asked, what hit where, what moved, what was regretted.

Counters are in tokens where vLLM/SGLang count tokens (queries, hits), in blocks otherwise.
`to_dict()` uses metric names in the style of vLLM (`prefix_cache_queries_total`,
`prefix_cache_hits_total`) and SGLang (`cached_tokens_total{cache_source=device|host}`), so
the gateway can expose them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Upper bounds (seconds) of the regret histogram: time between eviction and the next request.
REGRET_BUCKETS_S: tuple[float, ...] = (1.0, 10.0, 60.0, 300.0, 1800.0, float("inf"))


@dataclass
class CacheStats:
    bytes_per_block: int = 0
    requests: int = 0
    query_tokens: int = 0
    hit_tokens_device: int = 0
    hit_tokens_host: int = 0
    query_blocks: int = 0
    hit_blocks_device: int = 0
    hit_blocks_host: int = 0
    evicted_blocks: int = 0  # left the device tier (demoted or dropped)
    demoted_blocks: int = 0  # copied device -> host (eviction or write-through)
    promoted_blocks: int = 0  # copied host -> device on a hit
    host_evicted_blocks: int = 0  # left the host tier
    dropped_blocks: int = 0  # left every tier
    demote_seconds: float = 0.0  # time spent in KVStore.copy_device_to_host
    promote_seconds: float = 0.0  # time spent in KVStore.copy_host_to_device
    regret_blocks: int = 0  # requested again after leaving every tier (within the ghost memory)
    regret_seconds_sum: float = 0.0
    regret_buckets: list[int] = field(default_factory=lambda: [0] * len(REGRET_BUCKETS_S))

    @property
    def hit_tokens(self) -> int:
        return self.hit_tokens_device + self.hit_tokens_host

    @property
    def computed_tokens(self) -> int:
        return self.query_tokens - self.hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def demoted_bytes(self) -> int:
        return self.demoted_blocks * self.bytes_per_block

    @property
    def promoted_bytes(self) -> int:
        return self.promoted_blocks * self.bytes_per_block

    def record_regret(self, seconds_since_eviction: float) -> None:
        self.regret_blocks += 1
        self.regret_seconds_sum += seconds_since_eviction
        for i, le in enumerate(REGRET_BUCKETS_S):
            if seconds_since_eviction <= le:
                self.regret_buckets[i] += 1
                break

    def to_dict(self) -> dict[str, float | int]:
        d: dict[str, float | int] = {
            "prefix_cache_requests_total": self.requests,
            "prefix_cache_queries_total": self.query_tokens,
            "prefix_cache_hits_total": self.hit_tokens,
            "prefix_cache_hit_rate": round(self.hit_rate, 6),
            "cached_tokens_total{cache_source=device}": self.hit_tokens_device,
            "cached_tokens_total{cache_source=host}": self.hit_tokens_host,
            "computed_tokens_total": self.computed_tokens,
            "prefix_cache_query_blocks_total": self.query_blocks,
            "cached_blocks_total{cache_source=device}": self.hit_blocks_device,
            "cached_blocks_total{cache_source=host}": self.hit_blocks_host,
            "prefix_cache_evicted_blocks_total": self.evicted_blocks,
            "prefix_cache_dropped_blocks_total": self.dropped_blocks,
            "prefix_cache_host_evicted_blocks_total": self.host_evicted_blocks,
            "prefix_cache_demoted_blocks_total": self.demoted_blocks,
            "prefix_cache_promoted_blocks_total": self.promoted_blocks,
            "prefix_cache_demoted_bytes_total": self.demoted_bytes,
            "prefix_cache_promoted_bytes_total": self.promoted_bytes,
            "prefix_cache_demote_seconds_total": round(self.demote_seconds, 6),
            "prefix_cache_promote_seconds_total": round(self.promote_seconds, 6),
            "prefix_cache_regret_blocks_total": self.regret_blocks,
            "prefix_cache_regret_seconds_sum": round(self.regret_seconds_sum, 6),
        }
        cumulative = 0
        for le, n in zip(REGRET_BUCKETS_S, self.regret_buckets, strict=True):
            cumulative += n
            label = "+Inf" if le == float("inf") else f"{le:g}"
            d[f"prefix_cache_regret_seconds_bucket{{le={label}}}"] = cumulative
        return d


def merge_stats(parts: list[dict[str, float | int]]) -> dict[str, float]:
    """Several caches' `to_dict()`s as one (a data-parallel engine's ranks): counters add up, the
    hit rate is taken again from the summed counts (summed, four ranks at 0.8 read 3.2)."""
    merged: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            merged[key] = merged.get(key, 0) + value
    queries = merged.get("prefix_cache_queries_total", 0)
    merged["prefix_cache_hit_rate"] = merged.get("prefix_cache_hits_total", 0) / queries if queries else 0.0
    return merged
