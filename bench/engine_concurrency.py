"""Aggregate output tokens/s of the embedded engine at 1, 4 and 8 concurrent streams, beside
llama.cpp on the same GGUF and threads, in one run.

    .venv/bin/python bench/engine_concurrency.py [--streams 1,4,8] [--threads 2] [--json OUT]

Each stream is a request with its own random --prompt-tokens prompt asking for --output-tokens
tokens (EOS ignored) at --temperature (0.2: the local profile's default for Claude Code's main
loop). All streams are submitted at once through `EmbeddedEngine.submit`, the call the server
makes; aggregate tokens/s = all output tokens / wall time from the first submit to the last
final token (prefill included); also printed, the decode phase alone (tokens after each
stream's first / time from the first first-token to the last final token). `--invariance` picks
the engine's batch-invariance mode
(EmbeddedEngineConfig.batch_invariance): "greedy" (the default) serves these sampled requests on
the shared path, "all" shows what full batch invariance costs; `--weights` the decode weights
and `--float-weights` the prompts' (int4 and auto by default, as the local profile runs).

llama.cpp runs through llama-cpp-python (`Llama.generate` over the same token ids, the same
sampling, n_threads = --threads), in a process of its own (bench/side_process.py says why). Its
server (`llama_cpp.server`) serves one completion at a time per model, so N concurrent streams take
N times one stream; they are run one after another here, which is what its server does with them.
Skipped, saying why, when llama_cpp is not installed.

The machine may be shared: engine and llama.cpp runs alternate, the best of --repeats is kept
(load only ever slows a run), and the 1-minute load average is printed beside each row.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from side_process import SideProcess  # noqa: E402

from ikcode.engines.base import EngineRequest, SamplingParams  # noqa: E402
from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig  # noqa: E402
from ikcode.engines.embedded.threads import hand_threads_to_engine  # noqa: E402
from ikcode.model.default_model import find_default_model_file  # noqa: E402
from ikcode.model.loader import LoadedModel, load_model  # noqa: E402

FIRST_PLAIN_TOKEN = 17  # SmolLM2's 17 special tokens come first


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(n)]


class EngineSide:
    def __init__(
        self, model: LoadedModel, threads: int, invariance: str, weights: tuple[str, str], max_streams: int
    ):
        self.engine = EmbeddedEngine(
            model.config,
            model.state_dict,
            EmbeddedEngineConfig(
                kv_memory_bytes=256 * 1024 * 1024,
                num_threads=threads,
                device="cpu",
                max_num_seqs=max_streams,
                batch_invariance=invariance,
                weights=weights[0],
                float_weights=weights[1],
            ),
        )
        self.engine.start()

    def aggregate_tps(
        self, prompts: list[list[int]], output_tokens: int, temperature: float
    ) -> tuple[float, float]:
        """(all output tokens / wall time, tokens after the first / the decode phase's time)."""
        sampling = SamplingParams(temperature=temperature, max_tokens=output_tokens, ignore_eos=True)
        started = time.perf_counter()
        streams = [
            self.engine.submit(EngineRequest(uuid.uuid4().hex, p, sampling, cache_salt=uuid.uuid4().hex))
            for p in prompts
        ]
        total, firsts, ends = 0, [], []
        for stream in streams:
            tokens, final = stream.collect(timeout_s=900)
            if final.error is not None:
                raise RuntimeError(f"engine error: {final.error}")
            total += len(tokens)
            firsts.append(final.stats.first_token_at)
            ends.append(final.stats.finished_at)
        wall = time.perf_counter() - started
        return total / wall, (total - len(prompts)) / (max(ends) - min(firsts))

    def close(self) -> None:
        self.engine.shutdown(drain_timeout_s=5)


class LlamaCppSide:
    """Built in its own process (SideProcess)."""

    def __init__(self, gguf: Path, threads: int, context_tokens: int):
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(gguf),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=context_tokens,
            verbose=False,
        )

    def one_stream(self, prompt: list[int], output_tokens: int, temperature: float) -> tuple[int, float]:
        """(tokens produced, seconds from the first token to the last)."""
        produced, first_at = 0, 0.0
        for _ in self.llm.generate(prompt, temp=temperature, top_k=0, top_p=1.0, reset=True):
            produced += 1
            if produced == 1:
                first_at = time.perf_counter()
            if produced == output_tokens:
                break
        return produced, time.perf_counter() - first_at

    def aggregate_tps(
        self, prompts: list[list[int]], output_tokens: int, temperature: float
    ) -> tuple[float, float]:
        started = time.perf_counter()
        runs = [self.one_stream(p, output_tokens, temperature) for p in prompts]
        total = sum(n for n, _ in runs)
        return total / (time.perf_counter() - started), (total - len(runs)) / sum(s for _, s in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,4,8", help="comma-separated concurrent stream counts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--invariance", default="greedy", choices=("all", "greedy", "off"))
    parser.add_argument("--weights", default="int4", choices=("fp32", "int8", "int4"))
    parser.add_argument("--float-weights", default="auto", choices=("fp32", "bf16", "auto"))
    parser.add_argument("--repeats", type=int, default=2, help="runs per measure (best kept)")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)

    counts = [int(n) for n in args.streams.split(",")]
    rng = random.Random(args.seed)
    hand_threads_to_engine(args.threads)  # before any torch op here (threads.py)
    model = load_model(None)
    gguf = find_default_model_file()
    vocab = model.config.vocab_size
    print(f"model {model.config.name} ({gguf.name}); {args.threads} threads; {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    engine = EngineSide(model, args.threads, args.invariance, (args.weights, args.float_weights), max(counts))
    llama = None
    why_not = ""
    rows = []
    try:
        if args.skip_llamacpp:
            why_not = "--skip-llamacpp"
        elif importlib.util.find_spec("llama_cpp") is None:  # imported only in its own process
            why_not = "llama_cpp is not installed"
        else:
            context = args.prompt_tokens + args.output_tokens + 16
            llama = SideProcess(LlamaCppSide, gguf, args.threads, context)
        sides = {"engine": engine.aggregate_tps}
        if llama is not None:
            sides["llamacpp"] = functools.partial(llama.call, "aggregate_tps")
        engine.aggregate_tps([random_prompt(rng, 16, vocab)], 4, args.temperature)  # warm-up
        for n in counts:
            best = dict.fromkeys(("engine", "engine_decode", "llamacpp", "llamacpp_decode"), 0.0)
            for _ in range(args.repeats):
                prompts = [random_prompt(rng, args.prompt_tokens, vocab) for _ in range(n)]
                for name, aggregate_tps in sides.items():
                    both, decode = aggregate_tps(prompts, args.output_tokens, args.temperature)
                    best[name] = max(best[name], both)
                    best[name + "_decode"] = max(best[name + "_decode"], decode)
            rows.append({"streams": n, **best, "load_avg": os.getloadavg()[0]})
            print(f"  {n} streams done", flush=True)
    finally:
        engine.close()
        if llama is not None:
            llama.close()

    print(f"\n{args.prompt_tokens}-token prompts, {args.output_tokens} output tokens per stream, "
          f"temperature {args.temperature}, engine batch_invariance={args.invariance} "
          f"weights={args.weights}, float_weights={args.float_weights}; best of {args.repeats}")  # fmt: skip
    print(
        "llama.cpp: "
        + ("llama-cpp-python, streams served one after another" if llama else f"skipped: {why_not}")
    )
    sections = (
        ("", "end to end (prompt + output, all output tokens / wall time)"),
        ("_decode", "decode phase (tokens after the first / time from first token to last)"),
    )
    for key, what in sections:
        print(f"\naggregate output tok/s, {what}")
        print(f"{'streams':>7} | {'engine':>8} {'x own 1':>8} | {'llama.cpp':>9} {'x own 1':>8} | "
              f"{'engine/llama':>12} | load avg")  # fmt: skip
        single = rows[0]["engine" + key] if rows and rows[0]["streams"] == 1 else None
        single_lc = rows[0]["llamacpp" + key] if rows and rows[0]["streams"] == 1 else None
        for r in rows:
            e, lc = r["engine" + key], r["llamacpp" + key]
            own = f"{e / single:.2f}x" if single else "-"
            own_lc = f"{lc / single_lc:.2f}x" if single_lc else "-"
            ratio = f"{e / lc:.2f}" if lc else "-"
            print(f"{r['streams']:>7} | {e:>8.1f} {own:>8} | {lc if lc else '-':>9.5} {own_lc:>8} | "
                  f"{ratio:>12} | {r['load_avg']:.2f}")  # fmt: skip
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
