"""The gateway's own cost per warm request, engine excluded.

A Claude Code shaped conversation of ~450,000 tokens (default model's tokenizer) gets a new turn
whose tail is ~2,000 tokens. Per request we time what the gateway does before the engine runs:
parse the JSON body and validate it, render (tokenizing only new segments), hash the prompt's
blocks (resumed from the previous turn) and look the hashes up in a PrefixCache that holds the
previous turn. Reported next to tokenizing the whole conversation from scratch, in one run.

    .venv/bin/python bench/gateway_overhead.py [--iterations 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from ikcode.cache import PrefixCache, hash_blocks
from ikcode.gateway.block_hashes import IncrementalBlockHasher
from ikcode.gateway.claude_code_shape import long_conversation, tool_round
from ikcode.gateway.render import Renderer
from ikcode.gateway.schemas import MessagesRequest
from ikcode.gateway.server import tune_garbage_collector
from ikcode.model.loader import load_model

BLOCK_SIZE = 16


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--target-tokens", type=int, default=450_000)
    parser.add_argument("--tail-tokens", type=int, default=2_000)
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args()

    tokenizer = load_model(None).tokenizer
    renderer = Renderer(tokenizer)

    def parse(raw: bytes):
        return MessagesRequest.model_validate_json(raw)  # what the app does

    def render(body):
        return renderer.render(body.system, body.tools, body.tool_choice, body.messages)

    # Size the conversation: measure chars per token on one probe, then grow to the target.
    probe = render(parse(json.dumps(long_conversation(rounds=4, result_chars=8_000)).encode()))
    probe_chars = len(json.dumps(long_conversation(rounds=4, result_chars=8_000)))
    chars_per_token = probe_chars / len(probe.token_ids)
    rounds = int(args.target_tokens * chars_per_token / 8_000)
    base = long_conversation(rounds=rounds, result_chars=8_000)
    tail_chars = int(args.tail_tokens * chars_per_token)

    # Cold reference: a fresh renderer tokenizes every segment; plus one encode of the whole text.
    renderer_cold = Renderer(tokenizer)
    base_raw = json.dumps(base).encode()
    started = time.perf_counter()
    body = parse(base_raw)
    cold = renderer_cold.render(body.system, body.tools, body.tool_choice, body.messages)
    cold_render_s = time.perf_counter() - started
    whole_text = tokenizer.decode(cold.token_ids)
    started = time.perf_counter()
    whole = tokenizer.encode(whole_text)
    whole_encode_s = time.perf_counter() - started
    started = time.perf_counter()
    hash_blocks(cold.token_ids, BLOCK_SIZE)
    full_hash_s = time.perf_counter() - started

    # The previous turn as the server saw it: rendered, hashed, its blocks committed to a cache.
    hasher = IncrementalBlockHasher(BLOCK_SIZE)
    previous = render(parse(base_raw))
    previous_hashes = hasher.hashes(previous)
    cache = PrefixCache(num_device_blocks=len(previous_hashes) + 4096, block_size=BLOCK_SIZE)
    cache.allocate("previous", previous_hashes, len(previous_hashes))
    cache.release("previous", previous_hashes)

    # As run_server does at start: long-lived objects leave the collector's generations and young
    # collections are rarer, so a full collection does not walk them every few requests.
    tune_garbage_collector()
    rng = random.Random(7)
    phases: dict[str, list[float]] = {"parse": [], "render": [], "hash": [], "lookup": [], "total": []}
    tail_tokens, prompt_tokens, hit_tokens = [], [], []
    for i in range(args.iterations):
        assistant, user = tool_round(rng, 10_000 + i, tail_chars)
        request = dict(base, messages=base["messages"] + [{"role": "assistant", "content": assistant},
                                                          {"role": "user", "content": user}])  # fmt: skip
        raw = json.dumps(request).encode()
        t0 = time.perf_counter()
        body = parse(raw)
        t1 = time.perf_counter()
        rendered = render(body)
        t2 = time.perf_counter()
        hashes = hasher.hashes(rendered)
        t3 = time.perf_counter()
        match = cache.match(hashes)
        t4 = time.perf_counter()
        for name, value in (("parse", t1 - t0), ("render", t2 - t1), ("hash", t3 - t2), ("lookup", t4 - t3),
                            ("total", t4 - t0)):  # fmt: skip
            phases[name].append(value * 1000)
        tail_tokens.append(rendered.fresh_tokens)
        prompt_tokens.append(len(rendered.token_ids))
        hit_tokens.append(match.device_blocks * BLOCK_SIZE)

    p50 = statistics.median(phases["total"])
    report = {
        "prompt_tokens": statistics.median(prompt_tokens),
        "new_tail_tokens_tokenized": statistics.median(tail_tokens),
        "cached_tokens_found": statistics.median(hit_tokens),
        "request_bytes": len(raw),
        "iterations": args.iterations,
        "warm_ms": {
            name: {"p50": round(statistics.median(v), 2), "p95": round(percentile(v, 0.95), 2)}
            for name, v in phases.items()
        },  # fmt: skip
        "cold_render_ms": round(cold_render_s * 1000, 1),
        "whole_text_encode_ms": round(whole_encode_s * 1000, 1),
        "whole_text_tokens": len(whole),
        "full_hash_ms": round(full_hash_s * 1000, 1),
        "speedup_vs_cold_render": round(cold_render_s * 1000 / p50, 1),
        "speedup_vs_whole_encode": round(whole_encode_s * 1000 / p50, 1),
    }
    print(json.dumps(report, indent=2))
    p95 = percentile(phases["total"], 0.95)
    print(f"\nwarm request overhead p50 {p50:.1f} ms, p95 {p95:.1f} ms; full re-tokenization "
          f"{whole_encode_s * 1000:.0f} ms (one encode) / {cold_render_s * 1000:.0f} ms (cold render): "
          f"{report['speedup_vs_whole_encode']}x / {report['speedup_vs_cold_render']}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
