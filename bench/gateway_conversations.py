"""A warm turn's cost in the gateway when many agents take turns: does it remember their conversations?

`bench/gateway_overhead.py` times one conversation's warm turn. A shared server holds many: N
agents, each with a conversation of ~T tokens, send their next turns in round robin (as a team's
agents do, each coming back after the others). The gateway keeps each conversation's previous
render and its segments' tokens in bounded LRU stores; a conversation it forgot is tokenized whole
on its next turn. Per warm turn we time what the server runs before the engine (body validation,
`messages._render_and_lookup`, the admission layer's lookup), against a real Gateway (`create_app`)
over an EmbeddedEngine whose one-layer model never runs (as gateway_overhead.py), once with the
4M-token bound every gateway had before `conversation_memory_tokens` (now the default when the
engine caches less) and once with the bound the gateway now takes from an engine that caches all N
conversations (4x B200: ~57M tokens).

Then two whole re-tokenizations at once on two threads against one alone: tokenizers hold the GIL
while they encode, so forgotten conversations' turns queue behind each other.

The garbage collector's pauses during the warm turns and the process's peak RSS are reported too.

    .venv/bin/python bench/gateway_conversations.py [--agents 24] [--context 450000] [--rounds 2]
        [--sized-only]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import statistics
import threading
import time

from gateway_overhead import percentile, stand_in_engine, write_json

from ikcode.admission import AdmissionConfig, AdmissionController
from ikcode.gateway.app import create_app
from ikcode.gateway.claude_code_shape import long_conversation, tool_round
from ikcode.gateway.conversation_store import DEFAULT_MEMORY_TOKENS
from ikcode.gateway.messages import _render_and_lookup
from ikcode.gateway.schemas import MessagesRequest
from ikcode.gateway.server import tune_garbage_collector
from ikcode.gateway.settings import GatewaySettings
from ikcode.model.loader import load_model

RESULT_CHARS = 8_000


def conversations(agents: int, context_tokens: int, chars_per_token: float) -> list[dict]:
    rounds = int(context_tokens * chars_per_token / RESULT_CHARS)
    return [long_conversation(rounds, RESULT_CHARS, seed=agent) for agent in range(agents)]


class CollectorPauses:
    """The garbage collector's pauses while `on` (each stops every thread of the process)."""

    def __init__(self) -> None:
        self.on = False
        self.pauses: list[float] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self.on:
            self.pauses.append(time.perf_counter() - self._started)


def run(model, bases: list[dict], memory_tokens: int, rounds: int, context_tokens: int) -> dict:
    """Every agent's first turn (cold), then `rounds` warm turns each, in round robin."""
    collector = CollectorPauses()
    gc.callbacks.append(collector)
    engine = stand_in_engine(model.config.vocab_size, context_tokens * 2)
    controller = AdmissionController(engine, AdmissionConfig())
    settings = GatewaySettings(conversation_memory_tokens=memory_tokens)
    gw = create_app(controller, model.tokenizer, settings).state.gateway
    tune_garbage_collector()
    rng = random.Random(11)
    requests = [dict(base) for base in bases]
    warm_ms: list[float] = []
    reused: list[int] = []
    for turn in range(rounds + 1):
        for agent, request in enumerate(requests):
            collector.on = turn > 0
            if turn:
                assistant, user = tool_round(rng, 10_000 * turn + agent, 8_000)
                added = [{"role": "assistant", "content": assistant}, {"role": "user", "content": user}]
                request = dict(request, messages=request["messages"] + added)
                requests[agent] = request
            raw = json.dumps(request).encode()
            started = time.perf_counter()
            body = MessagesRequest.model_validate_json(raw)
            rendered, _, hashes = _render_and_lookup(gw, body, "", f"agent-{agent}", {})
            controller.lookup(rendered.token_ids, "", hashes)
            if turn:
                warm_ms.append((time.perf_counter() - started) * 1000)
                reused.append(rendered.reused_tokens)
    gc.callbacks.remove(collector)
    engine.shutdown(drain_timeout_s=1)
    return {
        "memory_tokens": memory_tokens,
        "warm_turns": len(warm_ms),
        "warm_ms": {"p50": round(statistics.median(warm_ms), 1), "p95": round(percentile(warm_ms, 0.95), 1)},
        "warm_turns_from_previous_render": sum(1 for n in reused if n > 0),
        "collector_pauses_during_warm_turns": {
            "n": len(collector.pauses),
            "longest_ms": round(1000 * max(collector.pauses, default=0.0), 1),
        },
        "render_store": dict(zip(("conversations", "tokens"), gw.renderer.store.render_stats(), strict=True)),
    }


def two_threads(tokenizer, text: str) -> dict:
    """One whole encode alone, then two at once on two threads."""
    started = time.perf_counter()
    tokenizer.encode(text)
    alone = time.perf_counter() - started
    threads = [threading.Thread(target=tokenizer.encode, args=(text,)) for _ in range(2)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    both = time.perf_counter() - started
    return {"one_alone_s": round(alone, 2), "two_at_once_s": round(both, 2), "ratio": round(both / alone, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=24)
    parser.add_argument("--context", type=int, default=450_000, help="tokens of each conversation")
    parser.add_argument("--rounds", type=int, default=2, help="warm turns per agent")
    parser.add_argument("--sized-only", action="store_true", help="only the memory sized for all agents")
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args()

    model = load_model(None)
    probe = long_conversation(rounds=4, result_chars=RESULT_CHARS)
    probe_tokens = len(model.tokenizer.encode(json.dumps(probe)))
    bases = conversations(args.agents, args.context, len(json.dumps(probe)) / probe_tokens)
    sized = max(DEFAULT_MEMORY_TOKENS, 2 * args.agents * args.context)  # an engine caching them all
    memories = (sized,) if args.sized_only else (DEFAULT_MEMORY_TOKENS, sized)
    report = {
        "agents": args.agents,
        "context_tokens": args.context,
        "rows": [run(model, bases, mem, args.rounds, args.context) for mem in memories],
        "whole_encode_on_two_threads": two_threads(model.tokenizer, json.dumps(bases[0])),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }
    print(json.dumps(report, indent=2))
    print(f"\n{args.agents} agents x {args.context:,} tokens, {args.rounds} warm turns each, round robin:")
    for row in report["rows"]:
        ms = row["warm_ms"]
        print(f"  memory {row['memory_tokens']:>11,} tokens: warm turn p50 {ms['p50']:8.1f} ms, p95 "
              f"{ms['p95']:8.1f} ms; {row['warm_turns_from_previous_render']}/{row['warm_turns']} "
              f"from the previous render; longest collector pause "
              f"{row['collector_pauses_during_warm_turns']['longest_ms']:.0f} ms")  # fmt: skip
    two = report["whole_encode_on_two_threads"]
    print(f"  whole re-tokenization: one {two['one_alone_s']} s alone, two at once on two threads "
          f"{two['two_at_once_s']} s ({two['ratio']}x); peak RSS {report['peak_rss_mb']:,} MB")  # fmt: skip
    write_json(report, args.json)


if __name__ == "__main__":
    main()
