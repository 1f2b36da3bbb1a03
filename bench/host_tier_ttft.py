"""Time to first token of a conversation's next turn: cold, prefix on the device, prefix in host RAM.

    .venv/bin/python bench/host_tier_ttft.py [--prefix-tokens 3500] [--tail-tokens 200] [--json OUT]

On the embedded engine with the default model (load_model(None)), one engine, three readings of
the same prompt (a --prefix-tokens conversation so far + the same --tail-tokens new turn):
- cold: nothing cached (empty cache, its own salt);
- device hit: the prefix was computed by the previous turn and is still in device memory;
- host hit: the prefix was computed, then pushed out of the (deliberately small) device tier by
  other conversations, so it comes back from the host tier (a copy, not a prefill).
Each reading uses its own cache salt, so the three never share entries. Targets: host hit within
2x of the device hit, and at least 5x faster than cold. The three replies must be the same tokens
(temperature 0): a promoted prefix that computed different KV would show up here. The machine may
be shared: the load average is printed next to the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ikcode.engines.base import EngineRequest, LifecycleKind, RequestStats, SamplingParams  # noqa: E402
from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig  # noqa: E402
from ikcode.model.loader import load_model  # noqa: E402

FIRST_PLAIN_TOKEN = 17  # SmolLM2's special tokens come first


class Bench:
    def __init__(self, engine: EmbeddedEngine):
        self.engine = engine
        self._released: dict[str, threading.Event] = {}
        engine.add_listener(self._on_event)
        engine.start()

    def _on_event(self, event) -> None:
        if event.kind is LifecycleKind.RELEASED:
            self._released.setdefault(event.request_id, threading.Event()).set()

    def run(self, prompt: list[int], salt: str, max_tokens: int = 4) -> tuple[list[int], RequestStats]:
        request_id = uuid.uuid4().hex
        self._released.setdefault(request_id, threading.Event())
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = EngineRequest(request_id, prompt, sampling, cache_salt=salt)
        tokens, final = self.engine.submit(request).collect(600)
        if final.error is not None:
            raise RuntimeError(f"engine error: {final.error}")
        self._released[request_id].wait(60)  # committed to the cache at release
        assert final.stats is not None
        return tokens, final.stats


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    mc = model.config
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_PLAIN_TOKEN, mc.vocab_size) for _ in range(n)]

    prompt_tokens = args.prefix_tokens + args.tail_tokens
    # Device tier: one turn and a little room; host tier: several device tiers' worth.
    device_tokens = int(prompt_tokens * 1.25) + 256
    config = EmbeddedEngineConfig(
        kv_memory_bytes=mc.kv_bytes_per_token * device_tokens,
        host_kv_memory_bytes=mc.kv_bytes_per_token * device_tokens * 4,
        num_threads=args.threads,
        device=args.device,
    )
    engine = EmbeddedEngine(mc, model.state_dict, config)
    bench = Bench(engine)
    prefix, tail = tokens(args.prefix_tokens), tokens(args.tail_tokens)
    prompt = prefix + tail
    out: dict = {
        "model": mc.name,
        "device": str(engine.device),
        "threads": args.threads,
        "prefix_tokens": args.prefix_tokens,
        "tail_tokens": args.tail_tokens,
        "device_tier_blocks": engine.num_blocks,
        "host_tier_blocks": engine.cache.num_host_blocks,
        "device_tier_bytes": engine.runner.device_kv_bytes,
        "host_tier_bytes": engine.runner.host_kv_bytes,
        "host_pinned": engine.runner.host_pinned,
        "loadavg_before": os.getloadavg(),
    }
    try:
        bench.run(tokens(64), salt="warmup")
        readings: dict[str, list[RequestStats]] = {"cold": [], "device_hit": [], "host_hit": []}
        replies: dict[str, list[int]] = {}
        promote_s: list[float] = []
        for rep in range(args.repeats):
            # The previous turn of the conversation read from host RAM later: computed first, then
            # pushed off the (small) device tier by the other two readings' work.
            bench.run(prefix, salt=f"host-{rep}")
            # cold: the whole prompt computed
            replies["cold"], stats = bench.run(prompt, salt=f"cold-{rep}")
            readings["cold"].append(stats)
            # device hit: the previous turn (the prefix) is still on the device
            bench.run(prefix, salt=f"dev-{rep}")
            replies["device_hit"], stats = bench.run(prompt, salt=f"dev-{rep}")
            readings["device_hit"].append(stats)
            # host hit: the prefix must now be in host RAM only (other traffic if not yet)
            for i in range(3):
                look = engine.lookup(prompt, cache_salt=f"host-{rep}")
                if look.device_tokens == 0:
                    break
                bench.run(tokens(int(device_tokens * 0.6)), salt=f"filler-{rep}-{i}", max_tokens=1)
            assert look.device_tokens == 0 and look.host_tokens > 0, f"prefix not demoted: {look}"
            before = engine.cache.stats.promote_seconds
            replies["host_hit"], stats = bench.run(prompt, salt=f"host-{rep}")
            promote_s.append(engine.cache.stats.promote_seconds - before)
            readings["host_hit"].append(stats)
    finally:
        engine.shutdown(drain_timeout_s=5)
    out["loadavg_after"] = os.getloadavg()
    for name, stats_list in readings.items():
        ttfts = [s.ttft_s for s in stats_list if s.ttft_s is not None]
        last = stats_list[-1]
        out[name] = {
            "ttft_s": statistics.median(ttfts),
            "ttft_s_all": ttfts,
            "prompt_tokens": last.prompt_tokens,
            "cached_tokens_device": last.cached_tokens_device,
            "cached_tokens_host": last.cached_tokens_host,
            "computed_tokens": last.computed_tokens,
        }
    out["host_hit"]["promote_seconds"] = statistics.median(promote_s)
    out["host_hit"]["promote_bytes"] = out["host_hit"]["cached_tokens_host"] * mc.kv_bytes_per_token
    out["same_reply_tokens"] = replies["cold"] == replies["device_hit"] == replies["host_hit"]
    cold, dev, host = (out[k]["ttft_s"] for k in ("cold", "device_hit", "host_hit"))
    out["host_over_device"] = host / dev
    out["cold_over_host"] = cold / host
    out["targets_met"] = {
        "host_within_2x_of_device": host <= 2 * dev,
        "host_at_least_5x_faster_than_cold": cold >= 5 * host,
        "same_reply_tokens": out["same_reply_tokens"],
    }
    return out


def print_table(r: dict) -> None:
    print(f"model {r['model']} on {r['device']}, {r['threads']} threads; prompt = {r['prefix_tokens']} "
          f"prefix + {r['tail_tokens']} new tokens; device tier {r['device_tier_blocks']} blocks "
          f"({r['device_tier_bytes'] / 2**20:.0f} MiB), host tier {r['host_tier_blocks']} blocks "
          f"({r['host_tier_bytes'] / 2**20:.0f} MiB, pinned={r['host_pinned']})")  # fmt: skip
    print(f"| {'reading':<11} | {'TTFT s':>8} | {'from device':>11} | {'from host':>9} | {'computed':>8} |")
    print("|" + "---|" * 5)
    for name in ("cold", "device_hit", "host_hit"):
        x = r[name]
        print(f"| {name:<11} | {x['ttft_s']:>8.3f} | {x['cached_tokens_device']:>11} | "
              f"{x['cached_tokens_host']:>9} | {x['computed_tokens']:>8} |")  # fmt: skip
    h = r["host_hit"]
    print(f"host hit: {h['promote_bytes'] / 2**20:.0f} MiB promoted in {h['promote_seconds']:.3f} s")
    print(
        f"host/device TTFT {r['host_over_device']:.2f}x (target <= 2x); "
        f"cold/host {r['cold_over_host']:.1f}x (target >= 5x); same reply tokens: {r['same_reply_tokens']}"
    )
    la, lb = r["loadavg_before"], r["loadavg_after"]
    print(f"load average (1/5/15 min) before {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}, "
          f"after {lb[0]:.2f} {lb[1]:.2f} {lb[2]:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--prefix-tokens", type=int, default=3500)
    parser.add_argument("--tail-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = measure(args)
    result["wall_s"] = time.perf_counter() - started
    print_table(result)
    print(f"wall time {result['wall_s']:.0f} s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0 if all(result["targets_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
