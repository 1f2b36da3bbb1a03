"""An oversized request is refused before it is paid for, and a small one beside it is not slowed.

Serves the default model (SmolLM2-135M, the `local` profile's window) over HTTP on 127.0.0.1 and,
for each oversized body, sends it at the same moment as a 1-token request, timing both. Each
body is refused by a different check (bytes by Content-Length, bytes while streaming, characters,
tokens). The baseline is the 1-token request alone, in the same run.

    .venv/bin/python bench/request_bounds.py [--repeats 3] [--port 21401]

Targets: every oversized body answered with a 4xx in < 2 s, the concurrent 1-token request
done in < 2 s. Prints a table and the load average (timings on a shared machine are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator

import httpx

from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from ikcode.gateway import GatewaySettings, create_app
from ikcode.gateway.server import BackgroundServer
from ikcode.model.loader import load_model
from ikcode.profiles import load_profile

MODEL = "smollm2-135m-instruct"
MB = 1024 * 1024


def body(text: str, max_tokens: int = 1) -> bytes:
    message = {"role": "user", "content": text}
    return json.dumps({"model": MODEL, "max_tokens": max_tokens, "messages": [message]}).encode()


def chunked(data: bytes, size: int = MB) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def timed_post(url: str, content: bytes | Iterator[bytes]) -> tuple[float, int]:
    started = time.perf_counter()
    try:
        response = httpx.post(
            f"{url}/v1/messages", content=content, headers={"content-type": "application/json"}, timeout=120
        )
        status = response.status_code
        if status >= 400:
            assert response.json()["type"] == "error", response.text[:200]
    except httpx.HTTPError:
        status = -1  # the connection failed: no answer at all
    return time.perf_counter() - started, status


def side_by_side(url: str, big: bytes | None, make_big) -> dict[str, float]:
    """The oversized request and a 1-token request sent at the same moment."""
    results: dict[str, tuple[float, int]] = {}
    threads = []
    if big is not None:
        threads.append(
            threading.Thread(target=lambda: results.__setitem__("big", timed_post(url, make_big())))
        )
    small = body("Say hi.")
    threads.append(threading.Thread(target=lambda: results.__setitem__("small", timed_post(url, small))))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out = {"small_s": results["small"][0], "small_status": results["small"][1]}
    if big is not None:
        out.update(big_s=results["big"][0], big_status=results["big"][1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=21401)
    args = parser.parse_args()

    profile = load_profile("local")
    loaded = load_model(None)
    engine = EmbeddedEngine(
        loaded.config,
        loaded.state_dict,
        EmbeddedEngineConfig(kv_memory_bytes=profile.model.kv_cache_mb * MB, num_threads=2, device="cpu"),
    )
    engine.start()
    settings = GatewaySettings(
        served_model=MODEL,
        context_window=profile.context_window,
        max_output_tokens=8,
        default_temperature=0.0,
    )
    app = create_app(engine, loaded.tokenizer, settings)
    server = BackgroundServer(app, port=args.port).start()
    gw = app.state.gateway
    url = server.url
    limit = gw.body_limit_bytes
    thirty = body("x" * (30 * MB))
    # Under the byte limit, over the character bound: refused before tokenizing.
    many_chars = body("y" * (limit - 200))
    # Under the character bound, over the window: tokenized, then refused by the token count.
    many_tokens = body("hello " * ((profile.context_window - 1) * gw.max_token_chars // 6 - 10))
    cases = [
        ("alone (baseline)", None, None),
        ("30 MB, Content-Length", thirty, lambda: thirty),
        ("30 MB, chunked", thirty, lambda: chunked(thirty)),
        (f"{len(many_chars) / MB:.2f} MB of characters", many_chars, lambda: many_chars),
        (f"{len(many_tokens) / MB:.2f} MB of tokens", many_tokens, lambda: many_tokens),
    ]
    timed_post(url, body("Warm up."))
    print(f"context window {profile.context_window} tokens, body limit {limit} bytes, "
          f"max token chars {gw.max_token_chars}; load average {os.getloadavg()[0]:.2f} (start)")  # fmt: skip
    print(
        f"{'oversized request':<28} {'its status':>10} {'its time s':>10} {'1-token s':>10} {'vs alone':>9}"
    )
    baseline = None
    for name, big, make in cases:
        runs = [side_by_side(url, big, make) for _ in range(args.repeats)]
        small = statistics.median(r["small_s"] for r in runs)
        assert all(r["small_status"] == 200 for r in runs), runs
        baseline = baseline or small
        if big is None:
            print(f"{name:<28} {'-':>10} {'-':>10} {small:>10.3f} {1.0:>8.2f}x")
            continue
        statuses = sorted({r["big_status"] for r in runs})
        big_s = max(r["big_s"] for r in runs)
        print(
            f"{name:<28} {','.join(map(str, statuses)):>10} {big_s:>10.3f} {small:>10.3f} "
            f"{small / baseline:>8.2f}x"
        )
    print(f"load average {os.getloadavg()[0]:.2f} (end); times: worst of {args.repeats} for the oversized "
          f"request, median of {args.repeats} for the 1-token one")  # fmt: skip
    server.stop()
    engine.shutdown(drain_timeout_s=5)


if __name__ == "__main__":
    main()
