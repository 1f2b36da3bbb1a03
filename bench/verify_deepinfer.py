"""Verify ikcode's DeepInfer backend on the real machine (4x B200, deepinfer 0.1.0 patched).

    python bench/verify_deepinfer.py --model /models/DeepSeek-V4.1-Flash            # 4 ranks
    python bench/verify_deepinfer.py --model /models/DeepSeek-V4.1-Flash --ranks 1  # one card
    python bench/verify_deepinfer.py --standin      # the same checks on the test stand-in (any CPU)

It builds the engine from the deepinfer-4xb200 profile (machine check first), then:
  1. quality gate: a long prompt asked cold, then again: the answers must be identical at
     temperature 0 and the repeat served >= 95% from the cache;
  2. hit rate: one conversation per rank, 3 turns each; every later turn must read >= 95% of the
     previous turn (prompt + reply) from the cache;
  3. TTFT: cold vs warm (median of the turns above);
  4. no leak: once idle, each rank's used KV blocks equal the cache's pinned blocks.
Exit status 0 when every check passes. Expected output on a healthy 4x B200 machine (numbers vary;
the hit rates and "identical" must not):

    machine: ok (4 ranks)
    quality gate: 16,384-token prompt, cold/warm answers identical, warm hit 98.9%   PASS
    hit rate: 8 later turns on 4 ranks, min 96.1% of the previous turn from cache   PASS
    TTFT: cold median 2.1 s, warm median 0.15 s (14x)                               PASS
    no leak: every rank idle, used blocks == pinned blocks                          PASS
    ALL PASS

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
from ikcode.engines.deepinfer import DeepInferConfig, DeepInferEngine, MachineCheckError  # noqa: E402

MIN_HIT = 0.95


def verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def build(args: argparse.Namespace):
    if args.standin:
        from tests.deepinfer_standin.harness import standin_engine

        return standin_engine(ranks=args.ranks, num_gpu_blocks=2048, max_model_len=65536), None
    from ikcode.engines.deepinfer.launch import load_tokenizer
    from ikcode.profiles import load_profile

    config = DeepInferConfig.from_profile(load_profile(args.profile), args.model)
    config.data_parallel_size = args.ranks or config.data_parallel_size
    return DeepInferEngine(config), load_tokenizer(config.model)


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


def ask(engine, rid: str, prompt: list[int], session: str, max_tokens: int = 64):
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0)
    tokens, final = engine.submit(EngineRequest(rid, prompt, sampling, session_id=session)).collect(600)
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
    parser.add_argument("--standin", action="store_true", help="run on the test stand-in (no GPU)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.standin:
        args.ranks = args.ranks or 4
    try:
        engine, tokenizer = build(args)
    except (MachineCheckError, ValueError) as err:
        print(f"machine: FAIL: {err}")
        return 2
    results: dict[str, object] = {"ranks": len(engine.ranks)}
    ok = True
    lines = [f"machine: ok ({len(engine.ranks)} ranks)"]
    try:
        # 1. quality gate
        doc = prompt_tokens(tokenizer, args.prompt_tokens, 1)
        cold, cold_final = ask(engine, "gate-cold", doc, "gate")
        warm, warm_final = ask(engine, "gate-warm", doc, "gate")
        same, hit = cold == warm, warm_final.stats.hit_rate
        passed = same and hit >= MIN_HIT and cold_final.stats.cached_tokens == 0
        ok &= passed
        cold_cached = cold_final.stats.cached_tokens
        results["quality_gate"] = {"identical": same, "warm_hit": hit, "cold_cached": cold_cached}
        answers = "identical" if same else "DIFFERENT"
        lines.append(f"quality gate: {len(doc):,}-token prompt, cold/warm answers {answers}, "
                     f"warm hit {hit:.1%}   {verdict(passed)}")  # fmt: skip
        # 2. hit rate and 3. TTFT
        hits, cold_ttft, warm_ttft = [], [cold_final.stats.ttft_s], [warm_final.stats.ttft_s]
        for rank in range(len(engine.ranks)):
            prompt = prompt_tokens(tokenizer, args.prompt_tokens // 2, 100 + rank)
            reused = 0
            for turn in range(3):
                reply, final = ask(engine, f"c{rank}-{turn}", prompt, f"conv-{rank}")
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
        # 4. no leak
        try:
            engine.check_invariants()
            leak_ok = engine.idle()
        except AssertionError as err:
            leak_ok = False
            results["leak"] = str(err)
        ok &= leak_ok
        lines.append(f"no leak: every rank idle, used blocks == pinned blocks   {verdict(leak_ok)}")
    finally:
        engine.shutdown(drain_timeout_s=5)
    lines.append("ALL PASS" if ok else "FAILED")
    results["ok"] = ok
    print(json.dumps(results, indent=2) if args.json else "\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
