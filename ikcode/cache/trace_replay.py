"""Replay a Mooncake-format trace through the real PrefixCache.

Trace format: one JSON object per line with `timestamp` (ms), `input_length`, `output_length`,
`hash_ids` (prefix-chained ids of 512-token blocks, len == ceil(input_length / 512)). There is no
model: a block's "content" is its trace id, and the cache's keys are the chained hashes of those
ids (hash_blocks over the id sequence with one id per block), so lookups follow prefix chaining
exactly as they would over token ids.

Requests run in timestamp order on a simulated clock; each one allocates its blocks, hits its
longest cached prefix (device, then host), and is released at once with every block committed:
what decides hits is reuse distance, which is what the trace is about. The infinite-cache bound
and Belady's optimal eviction at the same device capacity are computed over the same requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

from .hashing import BlockHash, hash_blocks
from .policy import EvictionPolicy
from .prefix_cache import PrefixCache
from .references import belady_hits, infinite_hits

TRACE_BLOCK_TOKENS = 512


@dataclass
class TraceRequest:
    t_s: float
    keys: list[BlockHash]
    block_tokens: list[int]  # tokens in each block (the last one may be partial)
    session: str  # the conversation it continues (see _sessions), a stand-in for a session id

    @property
    def tokens(self) -> int:
        return sum(self.block_tokens)


def load_trace(
    path_or_records: str | PathLike | Iterable[dict], block_tokens: int = TRACE_BLOCK_TOKENS
) -> list[TraceRequest]:
    if isinstance(path_or_records, str | PathLike):
        with open(Path(path_or_records)) as f:
            records = [json.loads(line) for line in f if line.strip()]
    else:
        records = list(path_or_records)
    records.sort(key=lambda r: r["timestamp"])  # stable: ties keep file order
    out: list[TraceRequest] = []
    for r in records:
        ids = [int(i) for i in r["hash_ids"]]
        if not ids:
            continue
        n = len(ids)
        last = int(r["input_length"]) - block_tokens * (n - 1)
        sizes = [block_tokens] * (n - 1) + [min(block_tokens, max(1, last))]
        keys = hash_blocks(ids, 1)
        out.append(TraceRequest(float(r["timestamp"]) / 1000.0, keys, sizes, ""))
    _sessions(out, block_tokens)
    return out


def _sessions(requests: list[TraceRequest], block_tokens: int) -> None:
    """Give each request the session of the earlier request it continues, else a new one.

    The format has no session ids. A request continues an earlier one when its prompt contains
    that one's prompt up to its last full block (a next turn resends the conversation). Sharing
    only a root (a common system prompt) does not make two conversations one session.
    """
    ends: dict[BlockHash, str] = {}  # last full block of a prompt -> its session
    for i, req in enumerate(requests):
        session = None
        for k in range(len(req.keys) - 1, 0, -1):  # deepest first; a bare root is not enough
            session = ends.get(req.keys[k])
            if session is not None:
                break
        req.session = session or f"s{i}"
        full = len(req.keys) - (req.block_tokens[-1] < block_tokens)
        if full >= 1:
            ends[req.keys[full - 1]] = req.session


def _ratios(requests: list[TraceRequest], hits: list[int]) -> dict[str, float]:
    blocks = sum(len(r.keys) for r in requests)
    tokens = sum(r.tokens for r in requests)
    hit_tokens = sum(sum(r.block_tokens[:h]) for r, h in zip(requests, hits, strict=True))
    return {
        "hit_ratio_blocks": sum(hits) / blocks if blocks else 0.0,
        "hit_ratio_tokens": hit_tokens / tokens if tokens else 0.0,
    }


def replay_requests(
    requests: list[TraceRequest],
    device_blocks: int,
    host_blocks: int = 0,
    policy: str | EvictionPolicy = "lru",
    *,
    write_through: bool = False,
    block_tokens: int = TRACE_BLOCK_TOKENS,
) -> tuple[PrefixCache, list[int], list[int], int]:
    """Run the requests through a PrefixCache. Returns (cache, device hits, host hits, skipped)."""
    now = [0.0]
    cache = PrefixCache(
        device_blocks,
        block_tokens,
        host_blocks,
        policy=policy,
        write_through=write_through,
        clock=lambda: now[0],
    )
    dev_hits: list[int] = []
    host_hits: list[int] = []
    skipped = 0
    for i, req in enumerate(requests):
        now[0] = req.t_s
        n = len(req.keys)
        if n > device_blocks:  # can never fit: counted as a full miss
            skipped += 1
            dev_hits.append(0)
            host_hits.append(0)
            continue
        alloc = cache.allocate(str(i), req.keys, n, session_id=req.session, num_tokens=req.tokens)
        dev_hits.append(alloc.cached_blocks_device)
        host_hits.append(alloc.cached_blocks_host)
        cache.release(str(i), req.keys)
    return cache, dev_hits, host_hits, skipped


def replay_trace(
    path_or_records: str | PathLike | Iterable[dict] | list[TraceRequest],
    device_tokens: int,
    host_tokens: int = 0,
    policy: str | EvictionPolicy = "lru",
    *,
    write_through: bool = False,
    references: bool = True,
    block_tokens: int = TRACE_BLOCK_TOKENS,
) -> dict:
    """Replay a trace; return hit ratios (tokens, blocks), by tier, and the two references."""
    if isinstance(path_or_records, list) and path_or_records and isinstance(path_or_records[0], TraceRequest):
        requests = path_or_records
    else:
        requests = load_trace(path_or_records, block_tokens)
    device_blocks = max(1, device_tokens // block_tokens)
    host_blocks = max(0, host_tokens // block_tokens)
    cache, dev, host, skipped = replay_requests(
        requests, device_blocks, host_blocks, policy, write_through=write_through, block_tokens=block_tokens
    )
    total = [d + h for d, h in zip(dev, host, strict=True)]
    result: dict = {
        "policy": cache.policy.name,
        "requests": len(requests),
        "device_tokens": device_blocks * block_tokens,
        "host_tokens": host_blocks * block_tokens,
        "block_tokens": block_tokens,
        **_ratios(requests, total),
        "by_tier": {
            "device": _ratios(requests, dev),
            "host": _ratios(requests, [t - d for t, d in zip(total, dev, strict=True)]),
        },
        "oversize_requests": skipped,
        "stats": cache.snapshot(),
    }
    if references:
        keys = [r.keys for r in requests]
        result["infinite_bound"] = _ratios(requests, infinite_hits(keys))
        belady = belady_hits(keys, device_blocks)
        result["belady"] = {"capacity_blocks": device_blocks, **_ratios(requests, belady)}
        if host_blocks:
            both = device_blocks + host_blocks
            result["belady_device_plus_host"] = {
                "capacity_blocks": both,
                **_ratios(requests, belady_hits(keys, both)),
            }
    return result


def format_table(results: list[dict]) -> str:
    """One line per replay result: capacities, policy, hit ratio (tokens/blocks) and references."""
    head = (
        f"{'device':>8} {'host':>8} {'policy':>7} {'hit tok':>8} {'hit blk':>8} {'dev tok':>8} "
        f"{'host tok':>8} {'belady':>8} {'infinite':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        bel = r.get("belady", {}).get("hit_ratio_tokens")
        inf = r.get("infinite_bound", {}).get("hit_ratio_tokens")
        lines.append(
            f"{_tok(r['device_tokens']):>8} {_tok(r['host_tokens']):>8} {r['policy']:>7} "
            f"{r['hit_ratio_tokens']:8.3f} {r['hit_ratio_blocks']:8.3f} "
            f"{r['by_tier']['device']['hit_ratio_tokens']:8.3f} "
            f"{r['by_tier']['host']['hit_ratio_tokens']:8.3f} "
            f"{_fmt(bel):>8} {_fmt(inf):>8}"
        )
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _tok(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1_000_000:g}M"
    if n >= 1000:
        return f"{n / 1000:g}K"
    return str(n)
