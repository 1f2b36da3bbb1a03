"""The gateway's own cost per warm request, engine forward excluded, timed through the functions
the server calls.

A Claude Code shaped conversation of ~450,000 tokens (default model's tokenizer) gets a new turn
whose tail is ~2,000 tokens. Per request we time, in order, what the server runs before the
engine's forward: the body's validation (`MessagesRequest.model_validate_json`, as FastAPI does),
`messages._render_and_lookup` (render: the turns equal to the conversation's previous render take
its tokens, new turns are tokenized; session-prefix logging; the conversation's incremental block
hashes; the cache lookup when the prompt is under predict_usage_max_tokens) and the admission
layer's lookup (`AdmissionController.lookup`, as its `submit` calls it, with the carried hashes),
against a real Gateway (`create_app`) over a real EmbeddedEngine whose cache holds the previous
turn. The engine's model is a one-layer stand-in: no forward runs here, and a 450K-token KV pool
of the real model would not fit a laptop. Interleaved with those warm turns, the same functions
for a request whose conversation the gateway holds no previous render of (every message digested
and looked up, as each warm turn was rendered before renders were reused). Then what the engine
thread does with the prompt's hashes at admission (`Sequence.block_hashes`), with the carried
hashes and without. Reported next to tokenizing the whole conversation from scratch.

    .venv/bin/python bench/gateway_overhead.py [--iterations 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from ikcode.admission import AdmissionConfig, AdmissionController
from ikcode.cache import hash_blocks
from ikcode.engines.base import EngineRequest, RequestStream
from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from ikcode.engines.embedded.sequence import Sequence
from ikcode.gateway.app import create_app
from ikcode.gateway.claude_code_shape import long_conversation, tool_round
from ikcode.gateway.messages import _render_and_lookup
from ikcode.gateway.render import Renderer
from ikcode.gateway.schemas import MessagesRequest
from ikcode.gateway.server import tune_garbage_collector
from ikcode.gateway.settings import GatewaySettings
from ikcode.model.config import ModelConfig
from ikcode.model.loader import load_model

BLOCK_SIZE = 16


def stand_in_engine(vocab_size: int, context_tokens: int) -> EmbeddedEngine:
    """An EmbeddedEngine with the real cache and a one-layer model that never runs."""
    config = ModelConfig(
        "llama", vocab_size, 64, 128, 1, 4, 1, 16, max_position_embeddings=context_tokens, name="stand-in"
    )
    names = {
        "model.embed_tokens.weight": (vocab_size, 64),
        "model.norm.weight": (64,),
        "lm_head.weight": (vocab_size, 64),
        "model.layers.0.self_attn.q_proj.weight": (64, 64),
        "model.layers.0.self_attn.k_proj.weight": (16, 64),
        "model.layers.0.self_attn.v_proj.weight": (16, 64),
        "model.layers.0.self_attn.o_proj.weight": (64, 64),
        "model.layers.0.mlp.gate_proj.weight": (128, 64),
        "model.layers.0.mlp.up_proj.weight": (128, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 128),
        "model.layers.0.input_layernorm.weight": (64,),
        "model.layers.0.post_attention_layernorm.weight": (64,),
    }
    state = {name: torch.zeros(shape) for name, shape in names.items()}
    kv_bytes = config.kv_bytes_per_token * context_tokens
    return EmbeddedEngine(config, state, EmbeddedEngineConfig(kv_memory_bytes=kv_bytes, device="cpu"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def write_json(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--target-tokens", type=int, default=450_000)
    parser.add_argument("--tail-tokens", type=int, default=2_000)
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args()

    model = load_model(None)
    tokenizer = model.tokenizer
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

    # The server's parts: a Gateway over the admission layer over an EmbeddedEngine (not started:
    # nothing is submitted); the previous turn went through the same path and its blocks are
    # committed to the engine's cache.
    engine = stand_in_engine(
        model.config.vocab_size, args.target_tokens + 4 * args.tail_tokens * args.iterations
    )
    controller = AdmissionController(engine, AdmissionConfig())
    gw = create_app(controller, tokenizer, GatewaySettings()).state.gateway
    previous_body = parse(base_raw)
    previous, _, previous_hashes = _render_and_lookup(gw, previous_body, "", "session", {})
    assert previous_hashes is not None
    engine.cache.allocate("previous", previous_hashes.hashes, len(previous_hashes.hashes))
    engine.cache.release("previous", previous_hashes.hashes)

    # As run_server does at start: long-lived objects leave the collector's generations and young
    # collections are rarer, so a full collection does not walk them every few requests.
    tune_garbage_collector()
    rng = random.Random(7)
    phases: dict[str, list[float]] = {
        "parse": [],
        "render_and_lookup": [],
        "admission_lookup": [],
        "total": [],
    }
    # The same functions for a conversation the gateway holds no previous render of (a session id
    # it has not seen: after an eviction or for a new client), so every message is digested and
    # looked up in the segment store, as every warm turn was rendered before renders were reused.
    # Interleaved with the warm turns, each with its own new tail, so both see the same load.
    without_previous: list[float] = []
    # CPU time of the warm turn's total: on a shared machine the wall time also counts the time
    # the process waited for a core, which this does not.
    cpu_ms: list[float] = []
    engine_hash_ms: dict[str, list[float]] = {"carried": [], "rehashed": []}
    tail_tokens, prompt_tokens, hit_tokens, reused_tokens = [], [], [], []
    for i in range(args.iterations):
        assistant, user = tool_round(rng, 10_000 + i, tail_chars)
        request = dict(base, messages=base["messages"] + [{"role": "assistant", "content": assistant},
                                                          {"role": "user", "content": user}])  # fmt: skip
        raw = json.dumps(request).encode()
        cpu0, t0 = time.process_time(), time.perf_counter()
        body = parse(raw)
        t1 = time.perf_counter()
        rendered, _, hashes = _render_and_lookup(gw, body, "", "session", {})
        t2 = time.perf_counter()
        match = controller.lookup(rendered.token_ids, "", hashes)
        t3 = time.perf_counter()
        cpu_ms.append((time.process_time() - cpu0) * 1000)
        for name, value in (("parse", t1 - t0), ("render_and_lookup", t2 - t1), ("admission_lookup", t3 - t2),
                            ("total", t3 - t0)):  # fmt: skip
            phases[name].append(value * 1000)
        assistant, user = tool_round(rng, 20_000 + i, tail_chars)
        other = dict(base, messages=base["messages"] + [{"role": "assistant", "content": assistant},
                                                        {"role": "user", "content": user}])  # fmt: skip
        other_raw = json.dumps(other).encode()
        t5 = time.perf_counter()
        other_body = parse(other_raw)
        other_rendered, _, other_hashes = _render_and_lookup(gw, other_body, "", f"new-session-{i}", {})
        controller.lookup(other_rendered.token_ids, "", other_hashes)
        without_previous.append((time.perf_counter() - t5) * 1000)
        assert other_rendered.reused_tokens == 0
        tail_tokens.append(rendered.fresh_tokens)
        reused_tokens.append(rendered.reused_tokens)
        prompt_tokens.append(len(rendered.token_ids))
        hit_tokens.append(match.device_tokens)
        # The engine thread at admission: the sequence's prompt hashes, carried or computed.
        for kind, carried in (("carried", hashes), ("rehashed", None)):
            request = EngineRequest(f"r{i}{kind}", rendered.token_ids, block_hashes=carried)
            seq = Sequence(
                request, RequestStream(request.request_id), max_total_tokens=len(rendered.token_ids) + 1
            )
            t4 = time.perf_counter()
            seq.block_hashes(len(rendered.token_ids), BLOCK_SIZE)
            engine_hash_ms[kind].append((time.perf_counter() - t4) * 1000)

    p50 = statistics.median(phases["total"])
    report = {
        "prompt_tokens": statistics.median(prompt_tokens),
        "new_tail_tokens_tokenized": statistics.median(tail_tokens),
        "tokens_from_previous_render": statistics.median(reused_tokens),
        "cached_tokens_found": statistics.median(hit_tokens),
        "request_bytes": len(raw),
        "iterations": args.iterations,
        "warm_ms": {
            name: {"p50": round(statistics.median(v), 2), "p95": round(percentile(v, 0.95), 2)}
            for name, v in phases.items()
        },  # fmt: skip
        "warm_total_cpu_ms": {
            "p50": round(statistics.median(cpu_ms), 2),
            "p95": round(percentile(cpu_ms, 0.95), 2),
        },
        "without_previous_render_total_ms": {
            "p50": round(statistics.median(without_previous), 2),
            "p95": round(percentile(without_previous, 0.95), 2),
        },
        "cold_render_ms": round(cold_render_s * 1000, 1),
        "whole_text_encode_ms": round(whole_encode_s * 1000, 1),
        "whole_text_tokens": len(whole),
        "full_hash_ms": round(full_hash_s * 1000, 1),
        "engine_thread_prompt_hash_ms": {
            k: round(statistics.median(v), 3) for k, v in engine_hash_ms.items()
        },
        "speedup_vs_cold_render": round(cold_render_s * 1000 / p50, 1),
        "speedup_vs_whole_encode": round(whole_encode_s * 1000 / p50, 1),
    }
    print(json.dumps(report, indent=2))
    p95 = percentile(phases["total"], 0.95)
    print(f"\nwarm request overhead p50 {p50:.1f} ms, p95 {p95:.1f} ms; full re-tokenization "
          f"{whole_encode_s * 1000:.0f} ms (one encode) / {cold_render_s * 1000:.0f} ms (cold render): "
          f"{report['speedup_vs_whole_encode']}x / {report['speedup_vs_cold_render']}x")  # fmt: skip
    cpu = report["warm_total_cpu_ms"]
    print(f"warm request overhead in CPU time: p50 {cpu['p50']:.1f} ms, p95 {cpu['p95']:.1f} ms")
    without = report["without_previous_render_total_ms"]["p50"]
    print(f"same request without the conversation's previous render (every message digested): "
          f"p50 {without:.1f} ms ({without / p50:.1f}x the warm turn's)")  # fmt: skip
    carried, rehashed = (report["engine_thread_prompt_hash_ms"][k] for k in ("carried", "rehashed"))
    print(f"engine thread, prompt hashes at admission: {carried} ms with the carried hashes "
          f"({rehashed} ms hashing them there)")  # fmt: skip
    write_json(report, args.json)


if __name__ == "__main__":
    main()
