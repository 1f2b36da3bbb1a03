"""Aggregate output tokens/s of the embedded engine at 1, 4 and 8 concurrent streams, beside
llama.cpp on the same GGUF and threads, in one run.

    .venv/bin/python bench/engine_concurrency.py [--streams 1,4,8] [--threads 2] [--json OUT]

Each stream is a request with its own random --prompt-tokens prompt asking for --output-tokens
tokens (EOS ignored) at --temperature (0.2: the local profile's default for Claude Code's main
loop). All streams are submitted at once through `EmbeddedEngine.submit`, the call the server
makes; aggregate tokens/s = all output tokens / wall time from the first submit to the last
final token (prefill included). `--invariance` picks the engine's batch-invariance mode
(EmbeddedEngineConfig.batch_invariance): "greedy" (the default) serves these sampled requests on
the shared path, "all" shows what full batch invariance costs; `--weights` the decode weights
(int8 by default, as the local profile runs).

llama.cpp runs through llama-cpp-python (`Llama.generate` over the same token ids, the same
sampling, n_threads = --threads). Its server (`llama_cpp.server`) serves one completion at a time
per model, so N concurrent streams take N times one stream; they are run one after another here,
which is what its server does with them. Skipped, saying why, when llama_cpp is not installed.

The machine may be shared: engine and llama.cpp runs alternate, the best of --repeats is kept
(load only ever slows a run), and the 1-minute load average is printed beside each row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ikcode.engines.base import EngineRequest, SamplingParams  # noqa: E402
from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig  # noqa: E402
from ikcode.model.default_model import find_default_model_file  # noqa: E402
from ikcode.model.loader import LoadedModel, load_model  # noqa: E402

FIRST_PLAIN_TOKEN = 17  # SmolLM2's 17 special tokens come first


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(n)]


class EngineSide:
    def __init__(self, model: LoadedModel, threads: int, invariance: str, weights: str, max_streams: int):
        torch.set_num_threads(threads)
        self.engine = EmbeddedEngine(
            model.config,
            model.state_dict,
            EmbeddedEngineConfig(
                kv_memory_bytes=256 * 1024 * 1024,
                num_threads=threads,
                device="cpu",
                max_num_seqs=max_streams,
                batch_invariance=invariance,
                weights=weights,
            ),
        )
        self.engine.start()

    def aggregate_tps(self, prompts: list[list[int]], output_tokens: int, temperature: float) -> float:
        sampling = SamplingParams(temperature=temperature, max_tokens=output_tokens, ignore_eos=True)
        started = time.perf_counter()
        streams = [
            self.engine.submit(EngineRequest(uuid.uuid4().hex, p, sampling, cache_salt=uuid.uuid4().hex))
            for p in prompts
        ]
        total = 0
        for stream in streams:
            tokens, final = stream.collect(timeout_s=900)
            if final.error is not None:
                raise RuntimeError(f"engine error: {final.error}")
            total += len(tokens)
        return total / (time.perf_counter() - started)

    def close(self) -> None:
        self.engine.shutdown(drain_timeout_s=5)


class LlamaCppSide:
    def __init__(self, gguf: Path, threads: int, context_tokens: int):
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(gguf),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=context_tokens,
            verbose=False,
        )

    def one_stream(self, prompt: list[int], output_tokens: int, temperature: float) -> int:
        produced = 0
        for _ in self.llm.generate(prompt, temp=temperature, top_k=0, top_p=1.0, reset=True):
            produced += 1
            if produced == output_tokens:
                break
        return produced

    def aggregate_tps(self, prompts: list[list[int]], output_tokens: int, temperature: float) -> float:
        started = time.perf_counter()
        total = sum(self.one_stream(p, output_tokens, temperature) for p in prompts)
        return total / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,4,8", help="comma-separated concurrent stream counts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--invariance", default="greedy", choices=("all", "greedy", "off"))
    parser.add_argument("--weights", default="int8", choices=("fp32", "int8"))
    parser.add_argument("--repeats", type=int, default=2, help="runs per measure (best kept)")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)

    counts = [int(n) for n in args.streams.split(",")]
    rng = random.Random(args.seed)
    model = load_model(None)
    gguf = find_default_model_file()
    vocab = model.config.vocab_size
    print(f"model {model.config.name} ({gguf.name}); {args.threads} threads; {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    engine = EngineSide(model, args.threads, args.invariance, args.weights, max(counts))
    llama = None
    why_not = ""
    if args.skip_llamacpp:
        why_not = "--skip-llamacpp"
    else:
        try:
            llama = LlamaCppSide(gguf, args.threads, args.prompt_tokens + args.output_tokens + 16)
        except ImportError as err:
            why_not = f"llama_cpp not importable ({err})"
    engine.aggregate_tps([random_prompt(rng, 16, vocab)], 4, args.temperature)  # warm-up
    rows = []
    try:
        for n in counts:
            best = {"engine": 0.0, "llamacpp": 0.0}
            for _ in range(args.repeats):
                prompts = [random_prompt(rng, args.prompt_tokens, vocab) for _ in range(n)]
                best["engine"] = max(
                    best["engine"], engine.aggregate_tps(prompts, args.output_tokens, args.temperature)
                )
                if llama is not None:
                    tps = llama.aggregate_tps(prompts, args.output_tokens, args.temperature)
                    best["llamacpp"] = max(best["llamacpp"], tps)
            rows.append({"streams": n, **best, "load_avg": os.getloadavg()[0]})
            print(f"  {n} streams done", flush=True)
    finally:
        engine.close()

    single = rows[0]["engine"] if rows and rows[0]["streams"] == 1 else None
    print(f"\n{args.prompt_tokens}-token prompts, {args.output_tokens} output tokens per stream, "
          f"temperature {args.temperature}, engine batch_invariance={args.invariance} "
          f"weights={args.weights}; best of {args.repeats}")  # fmt: skip
    print(
        "llama.cpp: "
        + ("llama-cpp-python, streams served one after another" if llama else f"skipped: {why_not}")
    )
    print(
        f"{'streams':>7} | {'engine tok/s':>12} {'x own 1':>8} | {'llama.cpp':>10} {'engine/llama':>12} "
        "| load avg"
    )
    for r in rows:
        own = f"{r['engine'] / single:.2f}x" if single else "-"
        lc = f"{r['llamacpp']:.1f}" if llama else "-"
        ratio = f"{r['engine'] / r['llamacpp']:.2f}" if llama and r["llamacpp"] else "-"
        print(
            f"{r['streams']:>7} | {r['engine']:>12.1f} {own:>8} | {lc:>10} {ratio:>12} | {r['load_avg']:.2f}"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
