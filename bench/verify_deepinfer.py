"""Verify ikcode's DeepInfer backend: run the checks and print what was measured, and where.

    python bench/verify_deepinfer.py --model /models/DeepSeek-V4.1-Flash            # 4 ranks
    python bench/verify_deepinfer.py --model /models/DeepSeek-V4.1-Flash --ranks 1  # one card
    python bench/verify_deepinfer.py --cpu-harness --ranks 2   # DeepInfer's engine core on this CPU

It builds the engine from the deepinfer-4xb200 profile (machine check first), or, with
--cpu-harness, from DeepInfer's engine core built from its sdist on this CPU with the GPU parts
replaced by a deterministic CPU model (tests/deepinfer_build/; its timings say nothing about a
GPU). Then:
  1. quality gate: a long prompt asked cold, then again: the answers must be identical at
     temperature 0 and the repeat served >= 95% from the cache;
  2. one hold: in the middle of that warm turn, the blocks of its device hit are the sequence's
     own blocks, and no other block holds them (a hit copied into the sequence while the cached
     copy stays pinned would hold the prefix twice);
  3. hit rate: one conversation per rank, 3 turns each; every later turn must read >= 95% of the
     previous turn (prompt + reply) from the cache;
  4. TTFT: cold vs warm (median of the turns above), as measured on this machine;
  5. no leak: once idle, each rank's used KV blocks equal the cache's pinned blocks and every
     state slot is free.
Exit status 0 when every check passes. Nothing is printed that was not measured in this run.

A warm hit of 0% with identical answers is the silent-miss bug (cache committed at the final
token); different answers mean the restored pages or state do not equal recomputed ones.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ikcode.engines.base import EngineRequest, SamplingParams  # noqa: E402
from ikcode.engines.deepinfer import DeepInferConfig, DeepInferEngine, MachineCheckError, check_machine  # noqa: E402

MIN_HIT = 0.95


def verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def build(args: argparse.Namespace):
    if args.cpu_harness:
        import tempfile

        from tests.deepinfer_build.harness import real_engine

        folder = Path(tempfile.mkdtemp(prefix="ikcode-verify-"))
        return real_engine(folder, ranks=args.ranks, blocks=1024, max_model_len=65536), None
    from ikcode.engines.deepinfer.launch import load_tokenizer
    from ikcode.profiles import load_profile

    config = DeepInferConfig.from_profile(load_profile(args.profile), args.model)
    config.data_parallel_size = args.ranks or config.data_parallel_size
    check_machine(config.data_parallel_size)
    engine = DeepInferEngine(config)
    engine.start()
    return engine, load_tokenizer(config.model)


def where(args: argparse.Namespace) -> str:
    import os
    import platform

    if args.cpu_harness:
        load = os.getloadavg()[0]
        return (f"DeepInfer's engine core on this CPU ({platform.node()}, {os.cpu_count()} cores, "
                f"load {load:.1f}) with a deterministic CPU model: timings are not GPU figures")  # fmt: skip
    return f"{platform.node()}: deepinfer on GPUs, profile {args.profile}"


def prompt_tokens(tokenizer, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    if tokenizer is None:
        return [rng.randrange(3, 300) for _ in range(n)]
    words = "cache block rank prefix token window state engine server session reply tool".split()
    ids: list[int] = []
    while len(ids) < n:
        text = " ".join(rng.choice(words) for _ in range(400)) + f" The code is {rng.randrange(10**6)}.\n"
        ids += tokenizer.encode(text)
    return ids[:n]


def ask(
    engine, rid: str, prompt: list[int], session: str, max_tokens: int = 64, mid_turn: list | None = None
):
    """Run a request to its end. mid_turn: a list that receives engine.check() taken once the
    request has streamed its first tokens (it is still running then, unless that was all)."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0)
    stream = engine.submit(EngineRequest(rid, prompt, sampling, session_id=session))
    tokens: list[int] = []
    final = None
    if mid_turn is not None:
        event = next(iter(stream))
        tokens += event.token_ids
        if event.finished:
            final = event
        else:
            mid_turn.append(engine.check())
    if final is None:
        rest, final = stream.collect(600)
        tokens += rest
    deadline = time.monotonic() + 60
    while not engine.idle() and time.monotonic() < deadline:  # committed when DeepInfer frees it
        time.sleep(0.01)
    return tokens, final


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="the DeepSeek-V4.1-Flash folder")
    parser.add_argument("--profile", default="deepinfer-4xb200")
    parser.add_argument("--ranks", type=int, default=0, help="data-parallel ranks (default: the profile's)")
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument(
        "--cpu-harness", action="store_true", help="DeepInfer's engine core on this CPU (no GPU)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.cpu_harness:
        args.ranks = args.ranks or 2
        args.prompt_tokens = min(args.prompt_tokens, 8192)
    try:
        engine, tokenizer = build(args)
    except (MachineCheckError, ValueError) as err:
        print(f"machine: FAIL: {err}")
        return 2
    results: dict[str, object] = {"ranks": len(engine.ranks), "measured_on": where(args)}
    ok = True
    lines = [f"measured on: {where(args)}", f"machine: ok ({len(engine.ranks)} ranks)"]
    try:
        # 1. quality gate
        doc = prompt_tokens(tokenizer, args.prompt_tokens, 1)
        cold, cold_final = ask(engine, "gate-cold", doc, "gate")
        mid: list = []
        warm, warm_final = ask(engine, "gate-warm", doc, "gate", mid_turn=mid)
        same, hit = cold == warm, warm_final.stats.hit_rate
        passed = same and hit >= MIN_HIT and cold_final.stats.cached_tokens == 0
        ok &= passed
        cold_cached = cold_final.stats.cached_tokens
        results["quality_gate"] = {"identical": same, "warm_hit": hit, "cold_cached": cold_cached}
        answers = "identical" if same else "DIFFERENT"
        lines.append(f"quality gate: {len(doc):,}-token prompt, cold/warm answers {answers}, "
                     f"warm hit {hit:.1%}   {verdict(passed)}")  # fmt: skip
        # 2. one hold, from the warm turn's mid-turn counts (the only sequence then)
        hit_blocks = warm_final.stats.cached_tokens_device // 128
        if mid:
            shared = sum(c["blocks_pinned_in_sequences"] for c in mid[0])
            in_use = sum(c["blocks_total"] - c["blocks_free"] for c in mid[0])
            in_seq = sum(c["blocks_in_sequences"] for c in mid[0])
            held = 2 * hit_blocks - shared  # the sequence's copy + cached blocks not its own
            passed = hit_blocks > 0 and shared == hit_blocks  # no hit: nothing to hold once
            results["one_hold"] = {"hit_blocks": hit_blocks, "blocks_in_use": in_use,
                                   "blocks_in_sequence": in_seq, "hit_blocks_shared": shared}  # fmt: skip
            lines.append(f"one hold: mid-turn {in_use} blocks in use, {in_seq} in the sequence; its "
                         f"{hit_blocks}-block device hit held {held / max(hit_blocks, 1):.2f}x   "
                         f"{verdict(passed)}")  # fmt: skip
            ok &= passed
        else:
            lines.append("one hold: not measured (the warm turn ended with its first output)")
        # 3. hit rate and 4. TTFT
        hits, cold_ttft, warm_ttft = [], [cold_final.stats.ttft_s], [warm_final.stats.ttft_s]
        for rank in range(len(engine.ranks)):
            prompt = prompt_tokens(tokenizer, args.prompt_tokens // 2, 100 + rank)
            reused = 0
            for turn in range(3):
                reply, final = ask(engine, f"c{rank}-{turn}", prompt, f"conv-{rank}")
                if final.error is not None:
                    raise RuntimeError(f"c{rank}-{turn}: {final.error}")
                (warm_ttft if turn else cold_ttft).append(final.stats.ttft_s)
                if turn:
                    hits.append(final.stats.cached_tokens / reused)
                reused = len(prompt) + len(reply)
                prompt = prompt + reply + prompt_tokens(tokenizer, 400, 1000 * rank + turn)
        passed = min(hits) >= MIN_HIT
        ok &= passed
        results["hit_rates"] = hits
        lines.append(f"hit rate: {len(hits)} later turns on {len(engine.ranks)} ranks, min {min(hits):.1%} "
                     f"of the previous turn from cache   {verdict(passed)}")  # fmt: skip
        cold_s = statistics.median(t for t in cold_ttft if t is not None)
        warm_s = statistics.median(t for t in warm_ttft if t is not None)
        results["ttft_s"] = {"cold_median": cold_s, "warm_median": warm_s}
        speedup = cold_s / max(warm_s, 1e-9)
        lines.append(f"TTFT: cold median {cold_s:.3g} s, warm median {warm_s:.3g} s ({speedup:.0f}x)"
                     f"   {'PASS' if warm_s < cold_s else 'WARN'}")  # fmt: skip
        # 5. no leak
        try:
            deadline = time.monotonic() + 60  # the last turn is released a step or more after it ends
            checks = engine.check()
            while any(c["live"] or c["engine_unfinished"] for c in checks) and time.monotonic() < deadline:
                time.sleep(0.05)
                checks = engine.check()
            leak_ok = engine.idle() and all(
                c["blocks_total"] - c["blocks_free"] == c["blocks_pinned"]
                and c["state_slots_free"] == c["state_slots_free_at_start"]
                for c in checks
            )
            results["ranks_check"] = checks
        except Exception as err:
            leak_ok = False
            results["leak"] = str(err)
        ok &= leak_ok
        lines.append(
            f"no leak: every rank idle, used blocks == pinned blocks, state slots free   {verdict(leak_ok)}"
        )
    finally:
        engine.shutdown(drain_timeout_s=5)
    lines.append("ALL PASS" if ok else "FAILED")
    results["ok"] = ok
    print(json.dumps(results, indent=2) if args.json else "\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
