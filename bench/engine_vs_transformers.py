"""The embedded engine vs Hugging Face transformers on the default model, same weights and threads.

    .venv/bin/python bench/engine_vs_transformers.py [--threads 1,2] [--json OUT]

For each thread count, side by side:
- prefill tokens/s: a fresh random prompt (--prefill-tokens) to its first token;
- decode tokens/s: greedy tokens after the first, from a short prompt (--decode-tokens);
then, on the embedded engine only: time to first token of a --long-tokens prompt computed cold,
and of the same prompt plus a --tail-tokens tail once the first request has been released
(its prefix then comes from the cache). Beside the measured speedup, the work ratio: the cold
prompt's arithmetic over the warm tail's (`prefill_flops`). On a CPU, where prefill is compute
bound, the speedup can pass the work ratio only if the warm turn runs at a higher FLOP rate than
the cold one; both rates are printed.

transformers runs `LlamaForCausalLM` over the same weights (load_model, in a process of its own:
bench/side_process.py says why): a bare forward with its KV cache and `logits_to_keep=1`, no
generate() overhead, which is the most favourable reading of its speed. The machine may be shared
with other work, so the two run interleaved (engine, transformers, engine, ...), and each number is
the best of --repeats runs: background load only ever slows a run down, so the best run is the
closest to the machine's real speed. The 1-minute load average is printed next to each section
(above the core count means other work competed). Compare numbers from the same run only.
transformers (and accelerate) are bench dependencies, not runtime ones.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from side_process import SideProcess  # noqa: E402

from ikcode.engines.base import EngineRequest, LifecycleKind, SamplingParams  # noqa: E402
from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig  # noqa: E402
from ikcode.engines.embedded.threads import hand_threads_to_engine  # noqa: E402
from ikcode.model.config import ModelConfig  # noqa: E402
from ikcode.model.loader import LoadedModel, load_model  # noqa: E402

FIRST_PLAIN_TOKEN = 17  # SmolLM2's 17 special tokens come first


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(n)]


# ---- embedded engine --------------------------------------------------------------------------
class EngineBench:
    def __init__(self, model: LoadedModel, threads: int, kv_bytes: int, float_weights: str = "fp32"):
        self.engine = EmbeddedEngine(  # the engine thread takes `threads` (engines/embedded/threads.py)
            model.config,
            model.state_dict,
            EmbeddedEngineConfig(
                kv_memory_bytes=kv_bytes, num_threads=threads, device="cpu", float_weights=float_weights
            ),
        )
        self._released: dict[str, threading.Event] = {}
        self.engine_threads: list[int] = []
        self.engine.add_listener(self._on_event)
        self.engine.start()

    def _on_event(self, event) -> None:
        if event.kind is LifecycleKind.FIRST_TOKEN and not self.engine_threads:
            self.engine_threads.append(torch.get_num_threads())  # as seen on the engine thread
        if event.kind is LifecycleKind.RELEASED:
            self._released.setdefault(event.request_id, threading.Event()).set()

    def run(self, prompt: list[int], max_tokens: int, salt: str | None = None):
        request_id = uuid.uuid4().hex
        self._released.setdefault(request_id, threading.Event())
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        stream = self.engine.submit(
            EngineRequest(request_id, prompt, sampling, cache_salt=salt if salt is not None else request_id)
        )
        tokens, final = stream.collect(timeout_s=900)
        if final.error is not None:
            raise RuntimeError(f"engine error: {final.error}")
        self._released[request_id].wait(60)  # cache entries are committed at release
        return tokens, final.stats

    def prefill_tps(self, prompt: list[int]) -> float:
        _, stats = self.run(prompt, max_tokens=1)
        return len(prompt) / stats.ttft_s

    def decode_tps(self, prompt: list[int], new_tokens: int) -> float:
        tokens, stats = self.run(prompt, max_tokens=new_tokens + 1)
        return (len(tokens) - 1) / (stats.finished_at - stats.first_token_at)

    def close(self) -> None:
        self.engine.shutdown(drain_timeout_s=5)


# ---- transformers -----------------------------------------------------------------------------
class TransformersBench:
    """Built in its own process (`transformers_side`; bench/side_process.py says why)."""

    def __init__(self, model: LoadedModel):
        from transformers import LlamaConfig, LlamaForCausalLM

        c: ModelConfig = model.config
        hf_config = LlamaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rope_theta=c.rope_theta,
            rms_norm_eps=c.rms_norm_eps,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=c.tie_word_embeddings,
            attention_bias=c.attention_bias,
        )
        self.model = LlamaForCausalLM(hf_config).eval()
        missing, unexpected = self.model.load_state_dict(model.state_dict, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        self.model.tie_weights()
        # transformers 5.x renamed `past_key_values` to `cache`; accept both.
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def _prefill(self, prompt: list[int]):
        out = self.model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].argmax(), _cache_of(out)

    def prefill_tps(self, prompt: list[int]) -> float:
        started = time.perf_counter()
        self._prefill(prompt)
        return len(prompt) / (time.perf_counter() - started)

    @torch.inference_mode()
    def decode_tps(self, prompt: list[int], new_tokens: int) -> float:
        token, past = self._prefill(prompt)
        started = time.perf_counter()
        for _ in range(new_tokens):
            out = self.model(token.view(1, 1), use_cache=True, **{self._cache_arg: past})
            token, past = out.logits[0, -1].argmax(), _cache_of(out)
        return new_tokens / (time.perf_counter() - started)


def transformers_side(model_path: str | None, threads: int) -> TransformersBench:
    torch.set_num_threads(threads)
    return TransformersBench(load_model(model_path))


def _cache_of(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


# ---- the run ----------------------------------------------------------------------------------
def prefill_flops(c: ModelConfig, start: int, end: int) -> float:
    """Multiply-adds x 2 of prefilling positions [start, end) with [0, start) already cached: the
    decoder layers' matmuls for each new token (q, k, v, o, gate, up, down), the output layer for
    the one token sampled, and causal attention (QK^T and PV, every query head, each new token
    over the keys up to its own). Norms, RoPE and softmax are left out (a few FLOPs a value)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer_weights = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    new = end - start
    pairs = new * start + new * (new + 1) // 2  # (query, key) pairs, each query seeing itself
    matmuls = 2 * new * c.num_layers * layer_weights + 2 * c.hidden_size * c.vocab_size
    return matmuls + pairs * 4 * c.head_dim * c.num_heads * c.num_layers


def load_average() -> float:
    return os.getloadavg()[0]


def best_interleaved(repeats: int, measures: dict) -> dict:
    """Best (highest) of `repeats` runs of each measure, run in turn so load hits all alike."""
    best = dict.fromkeys(measures, 0.0)
    for _ in range(repeats):
        for name, measure in measures.items():
            best[name] = max(best[name], measure())
    return best


def bench_threads(model: LoadedModel, threads: int, args, rng: random.Random) -> dict:
    vocab = model.config.vocab_size
    kv_bytes = model.config.kv_bytes_per_token * (args.long_tokens + args.tail_tokens + 512)
    row: dict = {"threads": threads, "load_avg_start": load_average()}
    engine = EngineBench(model, threads, kv_bytes, args.float_weights)
    hf = None
    prefill_prompt = lambda: random_prompt(rng, args.prefill_tokens, vocab)  # noqa: E731
    decode_prompt = lambda: random_prompt(rng, 32, vocab)  # noqa: E731
    try:
        if not args.skip_transformers:
            hf = SideProcess(transformers_side, args.model, threads)
        engine.run(random_prompt(rng, 64, vocab), max_tokens=4)  # warm-up
        measures = {
            "engine_prefill_tps": lambda: engine.prefill_tps(prefill_prompt()),
            "engine_decode_tps": lambda: engine.decode_tps(decode_prompt(), args.decode_tokens),
        }
        if hf is not None:
            hf.call("prefill_tps", random_prompt(rng, 64, vocab))  # warm-up
            measures["hf_prefill_tps"] = lambda: hf.call("prefill_tps", prefill_prompt())
            measures["hf_decode_tps"] = lambda: hf.call("decode_tps", decode_prompt(), args.decode_tokens)
        # Prefill pairs first, then decode pairs: each pair back to back.
        order = sorted(measures, key=lambda name: "decode" in name)
        row |= best_interleaved(args.repeats, {name: measures[name] for name in order})
        row["load_avg_speed"] = load_average()
        row["engine_thread_count_seen"] = engine.engine_threads[0] if engine.engine_threads else None
        if not args.skip_ttft:
            colds, warms = [], []
            for _ in range(args.ttft_repeats):
                long_prompt = random_prompt(rng, args.long_tokens, vocab)
                salt = uuid.uuid4().hex  # same namespace for both requests, fresh for this pair
                _, cold = engine.run(long_prompt, max_tokens=1, salt=salt)
                tail = random_prompt(rng, args.tail_tokens, vocab)
                _, warm = engine.run(long_prompt + tail, max_tokens=1, salt=salt)
                colds.append(cold)
                warms.append(warm)
            cold = min(colds, key=lambda s: s.ttft_s)
            warm = min(warms, key=lambda s: s.ttft_s)
            cold_flops = prefill_flops(model.config, 0, args.long_tokens)
            warm_flops = prefill_flops(model.config, args.long_tokens, args.long_tokens + args.tail_tokens)
            row |= {
                "cold_ttft_s": cold.ttft_s,
                "cold_gflops_per_s": cold_flops / cold.ttft_s / 1e9,
                "cold_cached_tokens": cold.cached_tokens,
                "warm_ttft_s": warm.ttft_s,
                "warm_cached_tokens": warm.cached_tokens,
                "warm_prompt_tokens": warm.prompt_tokens,
                "warm_gflops_per_s": warm_flops / warm.ttft_s / 1e9,
                "warm_speedup": cold.ttft_s / warm.ttft_s,
                "work_ratio": cold_flops / warm_flops,
                "load_avg_ttft": load_average(),
            }
    finally:
        engine.close()
        if hf is not None:
            hf.close()
    return row


def print_table(rows: list[dict], args) -> None:
    def fmt(value, spec: str = ".1f") -> str:
        return "-" if value is None else format(value, spec)

    print(f"\nprefill: {args.prefill_tokens}-token prompts; decode: {args.decode_tokens} tokens; "
          f"best of {args.repeats}, interleaved; {os.cpu_count()} cores")  # fmt: skip
    print(f"{'threads':>7} | {'prefill tok/s':>25} | {'decode tok/s':>25} | {'load avg':>11}")
    print(f"{'':>7} | {'engine':>8} {'transf.':>8} {'ratio':>7} | {'engine':>8} {'transf.':>8} {'ratio':>7} "
          f"| {'start':>5} {'end':>5}")  # fmt: skip
    for r in rows:
        keys = ("engine_prefill_tps", "hf_prefill_tps", "engine_decode_tps", "hf_decode_tps")
        ep, hp, ed, hd = (r.get(k) for k in keys)
        pr = ep / hp if ep and hp else None
        dr = ed / hd if ed and hd else None
        print(f"{r['threads']:>7} | {fmt(ep):>8} {fmt(hp):>8} {fmt(pr, '.2f'):>7} | "
              f"{fmt(ed):>8} {fmt(hd):>8} {fmt(dr, '.2f'):>7} | "
              f"{r['load_avg_start']:>5.2f} {r['load_avg_speed']:>5.2f}")  # fmt: skip
    if not args.skip_ttft:
        print(f"\nembedded engine TTFT: {args.long_tokens}-token prompt cold, "
              f"then the same + {args.tail_tokens} new tokens warm; best of {args.ttft_repeats}")  # fmt: skip
        print(f"{'threads':>7} | {'cold s':>8} {'warm s':>8} {'speedup':>8} {'work':>6} | "
              f"{'GFLOP/s cold':>12} {'warm':>6} | {'warm cached/prompt':>20} | {'load avg':>8}")  # fmt: skip
        for r in rows:
            cached = f"{r['warm_cached_tokens']}/{r['warm_prompt_tokens']}"
            print(f"{r['threads']:>7} | {r['cold_ttft_s']:>8.2f} {r['warm_ttft_s']:>8.3f} "
                  f"{r['warm_speedup']:>7.1f}x {r['work_ratio']:>5.1f}x | {r['cold_gflops_per_s']:>12.1f} "
                  f"{r['warm_gflops_per_s']:>6.1f} | {cached:>20} | {r['load_avg_ttft']:>8.2f}")  # fmt: skip
        print(
            "work: the cold prompt's FLOPs over the warm tail's (prefill_flops), the speedup at equal "
            "FLOP rates"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=6000)
    parser.add_argument("--tail-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5, help="runs per speed measure (best kept)")
    parser.add_argument("--ttft-repeats", type=int, default=1, help="cold/warm pairs (best kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--float-weights", default="fp32", choices=("fp32", "bf16"), help="the engine's (transformers: fp32)"
    )
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", dest="json_out", default=None, help="write the results here")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    hand_threads_to_engine(None)  # before any torch op here (threads.py); each engine gets --threads
    model = load_model(args.model)
    how = "weight cache hit" if model.from_cache else "dequantized"
    print(f"model {model.config.name} from {model.source} ({how} in {model.load_seconds:.2f} s); "
          f"load average {load_average():.2f} on {os.cpu_count()} cores")  # fmt: skip
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        print(f"threads={threads} ...", flush=True)
        rows.append(bench_threads(model, threads, args, rng))
    print_table(rows, args)
    result = {
        "model": model.config.name,
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k != "json_out"},
        "rows": rows,
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
