"""Generate tiny-trace.jsonl: a Mooncake-format trace whose hit ratios are known by construction.

SESSIONS conversations take TURNS turns each, round-robin (turn 1 of every session, then turn
2, ...), one request per second. Every request starts with the same ROOT blocks (a shared system
prompt); turn k of a session holds its ADD*k own blocks (each turn appends ADD full blocks).

  infinite cache: every request hits ROOT + ADD*(k-1) blocks, except that the very first
                  request misses the root too.
  LRU, 32 blocks: between two turns of a session the others bring >= 38 new blocks, so a
                  session's own blocks are always gone; the root, touched by every request,
                  never is: each request but the first hits exactly ROOT blocks.
Run: python tests/data/make_tiny_trace.py > tests/data/tiny-trace.jsonl
"""

from __future__ import annotations

import json

SESSIONS, TURNS, ROOT, ADD = 20, 10, 4, 2


def records() -> list[dict]:
    out = []
    for k in range(1, TURNS + 1):
        for s in range(SESSIONS):
            own = [1000 + s * 100 + i for i in range(ADD * k)]  # ids unique to session s
            ids = list(range(ROOT)) + own
            out.append(
                {
                    "timestamp": len(out) * 1000,
                    "input_length": 512 * len(ids),
                    "output_length": 50,
                    "hash_ids": ids,
                }
            )
    return out


def expected() -> dict[str, float]:
    n = SESSIONS * TURNS
    blocks = SESSIONS * (TURNS * ROOT + ADD * TURNS * (TURNS + 1) // 2)
    inf_hits = SESSIONS * (TURNS * ROOT + ADD * TURNS * (TURNS - 1) // 2) - ROOT
    return {
        "blocks": blocks,
        "infinite": inf_hits / blocks,
        "lru_32": ROOT * (n - 1) / blocks,
        "distinct_blocks": ROOT + SESSIONS * TURNS * ADD,
    }


if __name__ == "__main__":
    for r in records():
        print(json.dumps(r))
