"""Hit ratio of the prefix cache on a Mooncake-format trace: plain LRU vs the ikcode policy vs
Belady vs the infinite-cache bound, at several device capacities, with and without a host tier.

Usage: python bench/trace_replay_table.py [TRACE] [--json OUT]
Default TRACE: ../shared/data/mooncake-synthetic-trace.jsonl (relative to the repository).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ikcode.cache.trace_replay import load_trace, replay_trace

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = (REPO / ".." / "shared" / "data" / "mooncake-synthetic-trace.jsonl").resolve()
DEVICE_TOKENS = (1_000_000, 4_000_000, 16_000_000)
HOST_TOKENS = (0, 64_000_000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    requests = load_trace(args.trace)
    rows = []
    for host in HOST_TOKENS:
        for device in DEVICE_TOKENS:
            lru = replay_trace(requests, device, host, "lru")
            ours = replay_trace(requests, device, host, "ikcode", references=False)
            belady = lru["belady_device_plus_host"] if host else lru["belady"]
            rows.append(
                {
                    "device_tokens": device,
                    "host_tokens": host,
                    "lru": lru,
                    "ikcode": ours,
                    "belady": belady,
                    "infinite_bound": lru["infinite_bound"],
                }
            )
    elapsed = time.perf_counter() - t0

    def cell(r: dict) -> str:
        return f"{r['hit_ratio_tokens']:.3f} ({r['hit_ratio_blocks']:.3f})"

    print(f"trace: {args.trace}: {len(requests)} requests; hit ratio in tokens (blocks)")
    head = "| device | host | plain LRU | ikcode | Belady | infinite | ikcode / infinite |"
    print(head)
    print("|" + "---|" * 7)
    for row in rows:
        host = f"{row['host_tokens'] // 1_000_000}M" if row["host_tokens"] else "-"
        frac = row["ikcode"]["hit_ratio_tokens"] / row["infinite_bound"]["hit_ratio_tokens"]
        print(
            f"| {row['device_tokens'] // 1_000_000}M | {host} | {cell(row['lru'])} | {cell(row['ikcode'])} "
            f"| {cell(row['belady'])} | {cell(row['infinite_bound'])} | {frac:.1%} |"
        )
    print("Belady: optimal eviction at the device capacity (device + host capacity in host-tier rows).")
    print(f"replayed {len(rows) * 2} runs in {elapsed:.1f} s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
