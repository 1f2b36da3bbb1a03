"""ikcode's added TTFT in front of an upstream: the same warm requests direct and through ikcode.

The upstream is an ikcode server over the tiny test model with a 32K window (fast, so the front's
own cost is visible), run in a child process. A ~20K-token conversation is sent once (cold),
then each iteration sends it again with a new short user turn (a warm request: the upstream reads
the conversation from its cache), streamed, alternating direct and through the upstream front
(kind "anthropic", one replica). TTFT is measured by this client: request sent -> first
`content_block_delta`. Reported: TTFT p50/p95 each way and the per-pair overhead p50/p95.

    .venv/bin/python bench/upstream_overhead.py [--iterations 40] [--tokens 20000] [--json out.json]
        [--admission ikcode|fifo]   (ikcode's admission policy in front, the default, or none)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TOKEN = "bench-upstream"
WINDOW = 32768


def serve_upstream(port: int) -> None:
    """Child process: the tiny-model ikcode server with a 32K window."""
    import torch

    from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from ikcode.gateway import GatewaySettings, create_app
    from ikcode.gateway.server import run_server
    from tests.test_gateway_support import tiny_tokenizer
    from tests.tiny_model import tiny_config, tiny_state_dict

    torch.set_num_threads(1)
    cfg = tiny_config(max_position_embeddings=WINDOW)
    engine = EmbeddedEngine(
        cfg,
        tiny_state_dict(cfg),
        EmbeddedEngineConfig(kv_memory_bytes=64 * 1024 * 1024, num_threads=1, device="cpu"),
    )
    engine.start()
    settings = GatewaySettings(
        served_model="tiny", max_output_tokens=64, auth_tokens={"bench": TOKEN}, default_temperature=0.0
    )
    run_server(create_app(engine, tiny_tokenizer(), settings), "127.0.0.1", port, log_level="warning")


def ttft(client: httpx.Client, url: str, key: str, body: dict, session: str) -> tuple[float, dict]:
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01", "X-Claude-Code-Session-Id": session}
    start = time.perf_counter()
    first = None
    usage: dict = {}
    with client.stream("POST", url + "/v1/messages", json=body, headers=headers) as response:
        response.raise_for_status()
        event = ""
        for line in response.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif event == "content_block_delta" and first is None:
                first = time.perf_counter() - start
            elif event == "message_delta" and line.startswith("data:"):
                usage = json.loads(line[5:])["usage"]
    return (first if first is not None else time.perf_counter() - start), usage


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--port", type=int, default=18761)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--admission", choices=("ikcode", "fifo"), default="ikcode", help="the front's admission policy"
    )
    parser.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        return serve_upstream(args.serve_upstream)

    from ikcode.admission import AdmissionConfig
    from ikcode.gateway import BackgroundServer, GatewaySettings
    from ikcode.upstream import UpstreamConfig, create_upstream_app

    child = subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(args.port)], cwd=ROOT)
    upstream_url = f"http://127.0.0.1:{args.port}"
    front = None
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(upstream_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or child.poll() is not None:
                raise SystemExit("the upstream did not start")
            time.sleep(0.2)
        with tempfile.TemporaryDirectory() as tmp:
            settings = GatewaySettings(
                served_model="tiny",
                context_window=WINDOW,
                max_output_tokens=64,
                auth_tokens={"bench": "bench-front"},
                request_log_path=Path(tmp) / "front.jsonl",
            )
            config = UpstreamConfig(kind="anthropic", urls=[upstream_url], token=TOKEN)
            admission = AdmissionConfig(policy=args.admission)
            front = BackgroundServer(create_upstream_app(config, settings, admission)).start()
            report = run(args, upstream_url, front.url) | {"admission": args.admission}
    finally:
        if front is not None:
            front.stop()
        child.terminate()
        child.wait(30)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def run(args, upstream_url: str, front_url: str) -> dict:
    words = "the parser reads tokens from the buffer until a newline then calls the handler".split()
    history = " ".join(words[i % len(words)] for i in range(int(args.tokens / 4.33)))  # ~4.33 tokens/word
    base = [{"role": "user", "content": history}, {"role": "assistant", "content": "ok"}]
    system = "You are a coding agent."
    direct, via = [], []
    with httpx.Client(timeout=600) as client:

        def body(i: int) -> dict:
            messages = base + [{"role": "user", "content": f"step {i}: what next?"}]
            return {"model": "tiny", "max_tokens": 1, "system": system, "messages": messages, "stream": True}

        cold_s, usage = ttft(client, upstream_url, TOKEN, body(-1), "bench")  # fills the upstream's cache
        prompt_tokens = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
        for i in range(3):  # warm both paths (connections, first-call costs)
            ttft(client, upstream_url, TOKEN, body(1000 + i), "bench")
            ttft(client, front_url, "bench-front", body(2000 + i), "bench")
        hits = []
        for i in range(args.iterations):
            d, _ = ttft(client, upstream_url, TOKEN, body(2 * i), "bench")
            v, usage = ttft(client, front_url, "bench-front", body(2 * i + 1), "bench")
            direct.append(d)
            via.append(v)
            hits.append(usage.get("cache_read_input_tokens", 0))
    overhead = [(v - d) * 1000 for d, v in zip(direct, via, strict=True)]
    ms = lambda values, q: round(pct(values, q) * 1000, 2)  # noqa: E731
    return {
        "prompt_tokens": prompt_tokens,
        "cold_ttft_ms": round(cold_s * 1000, 1),
        "iterations": args.iterations,
        "cache_read_tokens_p50_through_ikcode": statistics.median(hits),
        "direct_ttft_ms": {"p50": ms(direct, 0.5), "p95": ms(direct, 0.95)},
        "through_ikcode_ttft_ms": {"p50": ms(via, 0.5), "p95": ms(via, 0.95)},
        "added_ttft_ms": {
            "p50": round(pct(overhead, 0.5), 2),
            "p95": round(pct(overhead, 0.95), 2),
            "p50_of_medians": round((statistics.median(via) - statistics.median(direct)) * 1000, 2),
        },
        "cpu_count": os.cpu_count(),
    }


if __name__ == "__main__":
    main()
