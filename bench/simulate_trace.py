"""What happens inside a simulated run, over time: per-rank memory and queues, the admission queue
by kind, sessions active at once, tokens moved over PCIe, and TTFT and recomputed conversations by
window of send time. For explaining a number `ikcode bench --simulate` prints.

    python bench/simulate_trace.py --agents 200 --context 500000
    python bench/simulate_trace.py --agents 200 --context 500000 --set session_idle_s=30

Each sample line: t, admission queue (warm / cold / aged cold / new sessions waiting for a slot),
active sessions and their count per rank, then per rank: block usage, requests routed but not
allocated (p), allocated and prefilling (w), decoding (d), and blocks reloaded from / demoted to
the host tier so far (up / dn).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ikcode.admission import AdmissionConfig  # noqa: E402
from ikcode.bench import simulate  # noqa: E402
from ikcode.bench.hardware import HardwareModel, adapter_schedule  # noqa: E402
from ikcode.bench.results import TurnResult, percentile  # noqa: E402
from ikcode.bench.server import SimulatedServer  # noqa: E402
from ikcode.bench.workload import AgentsWorkload  # noqa: E402
from ikcode.profiles import load_profile  # noqa: E402

RECOMPUTED_TOKENS = 50_000  # a later turn that computed this much lost its conversation's cache


class TracedServer(SimulatedServer):
    every_s = 20.0

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.samples: list[str] = []
        self._next_at = 0.0
        TracedServer.last = self

    def step(self, horizon: float) -> None:
        if self.now >= self._next_at:
            self._next_at += self.every_s
            self.samples.append(self._sample())
        super().step(horizon)

    def _sample(self) -> str:
        policy, now = self.policy, self.now
        queue = policy.queue
        waiting_slot = sum(1 for t in queue if t.needs_slot)
        cold = [t for t in queue if t.cls.value == "cold" and not t.needs_slot]
        aged = sum(1 for t in cold if t.aged(now, policy.config.aging_s))
        warm = sum(1 for t in queue if t.cls.value == "warm")
        per_rank = Counter(self.router._sessions.get(key) for key in policy.slots._active)  # noqa: SLF001
        ranks = " | ".join(
            f"{r.usage():4.0%} p{len(r.pending)} w{len(r.waiting)} d{len(r.decoding)} "
            f"up{r.cache.stats.promoted_blocks} dn{r.cache.stats.demoted_blocks}"
            for r in self.ranks
        )
        spread = sorted(per_rank.values())
        return (
            f"{now:6.0f} s  queue {warm:3d}/{len(cold):3d}/{aged:3d}/{waiting_slot:3d}  "
            f"active {policy.slots.num_active():4d} {spread}  {ranks}"
        )


def windows(turns: list[TurnResult], width_s: float = 100.0) -> list[str]:
    lines = []
    end = max((t.sent_at for t in turns), default=0.0)
    lo = 0.0
    while lo <= end:
        sent = [t for t in turns if lo <= t.sent_at < lo + width_s and t.ttft_s is not None]
        warm = [t.ttft_s for t in sent if not t.cold and t.ttft_s is not None]
        cold = [t.ttft_s for t in sent if t.cold and t.ttft_s is not None]
        recomputed = sum(
            1 for t in sent if t.step > 0 and t.prompt_tokens - t.cached_tokens > RECOMPUTED_TOKENS
        )
        computed = sum(t.prompt_tokens - t.cached_tokens for t in sent)
        if sent:
            lines.append(
                f"sent {lo:5.0f}-{lo + width_s:5.0f} s: warm {len(warm):4d} p50 {percentile(warm, 50):6.2f} "
                f"p95 {percentile(warm, 95):6.2f} | cold {len(cold):3d} p50 {percentile(cold, 50):6.1f} | "
                f"computed {computed / 1e6:5.1f}M tokens, {recomputed} later turns recomputed"
            )
        lo += width_s
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", default="deepinfer-4xb200")
    parser.add_argument("--agents", type=int, default=200)
    parser.add_argument("--context", type=int, default=500_000)
    parser.add_argument("--duration", type=float, default=750.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="ikcode", choices=("fifo", "ikcode"))
    parser.add_argument("--every", type=float, default=20.0, help="seconds between samples")
    parser.add_argument("--set", action="append", default=[], help="admission knob, e.g. session_idle_s=30")
    args = parser.parse_args()

    profile = load_profile(args.profile)
    hw = HardwareModel.from_dict(profile.hardware, name=profile.name)
    knobs: dict[str, Any] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        knobs[key] = (
            value if not value.replace(".", "", 1).isdigit() else float(value) if "." in value else int(value)
        )
    admission = AdmissionConfig.from_dict(profile.admission, policy=args.policy, **knobs)
    workload = AgentsWorkload(
        agents=args.agents, context_tokens=args.context, duration_s=args.duration, seed=args.seed
    )
    TracedServer.every_s = args.every
    turns: list[TurnResult] = []
    summarize = simulate.summarize

    def keep(results: list[TurnResult], duration_s: float, config: dict[str, Any]) -> dict[str, Any]:
        turns.extend(results)
        return summarize(results, duration_s, config)

    block = int(profile.cache.get("simulate_block_size", 2048))
    with (
        mock.patch.object(simulate, "SimulatedServer", TracedServer),
        mock.patch.object(simulate, "summarize", keep),
    ):
        report = simulate.run_simulation(
            hw, admission, workload, block, str(profile.cache.get("policy", "lru")),
            engine_schedule=adapter_schedule(profile),
        )  # fmt: skip
    print("\n".join(TracedServer.last.samples))
    print("\n".join(windows(turns)))
    late = sorted(
        round(t.sent_at + t.ttft_s)
        for t in turns
        if t.ttft_s is not None and t.prompt_tokens - t.cached_tokens > RECOMPUTED_TOKENS
    )
    print(f"conversations read from zero after 400 s (first token at, s): {[s for s in late if s > 400]}")
    ttft, adm = report["ttft"], report["admission"]
    print(
        f"{args.policy}: {report['completed']} turns, median {ttft['p50']:.2f} s, p95 {ttft['p95']:.2f} s "
        f"(warm {ttft['warm']['p50']:.2f} / {ttft['warm']['p95']:.2f} s), failed {report['failed']}, "
        f"shed and retried {report['shed_retries']}, "
        f"sessions waited for a slot {adm.get('sessions_waited', 0)}, "
        f"warm queue wait p50 {adm['queue_wait']['warm']['p50_wait_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
