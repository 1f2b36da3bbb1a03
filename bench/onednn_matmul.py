"""The decoder layers' fp32 matmuls through MKL (`torch.mm` on [in, out] weights) vs oneDNN
(`mkldnn._linear_pointwise` on weights packed by `mkldnn._reorder_linear_weight`), side by side.

    .venv/bin/python bench/onednn_matmul.py [--rows 1,4,32,128,256,512] [--threads 2] [--repeats 10]

Shapes: the default model's (SmolLM2-135M: qkv 576x960, o 576x576, gate_up 576x3072, down
1536x576), each layer's four matmuls run for --repeats passes, times 30 layers, on random
weights (the speed does not depend on the values). The engine packs its fp32 weights for oneDNN
(LlamaModel.pack_for_onednn); the row counts are those it runs: 1-8 decode rows, prompt chunks.
Also checked: a row's bits do not depend on how many rows share the call, for oneDNN as for MKL
(the engine's batch invariance rests on it; tests/test_engine_determinism.py checks the outcome).

With --engine, then the whole engine on the default model, two of them side by side in turns
(`fp32_gemm="mkl"` and `"onednn"`, the local profile's weights otherwise: int4 decode rows, fp32
float weights on a CPU without native bf16), stepped on this thread: a 512-token prompt's prefill
(tokens/s), a temperature-0 request's decode (its tokens run as one-token prompts on the float
weights; tokens/s) and 8 sampled 32-token requests of 64 tokens at once (all output tokens / wall
time, prefill included). Best of --engine-repeats.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import uuid
from pathlib import Path

import torch

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # [in, out]
LAYERS = 30


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def seconds_per_pass(run, repeats: int) -> float:
    """Time of the 30 layers' matmuls: one layer's four, `repeats` times, scaled by 30."""
    for _ in range(2):
        run()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats * LAYERS


def rows_invariant(matmul, x: torch.Tensor) -> bool:
    whole = matmul(x)
    return all(
        torch.equal(matmul(x[start : start + n].contiguous()), whole[start : start + n])
        for n in (1, 4, 8, 12, 64, 100, 256)
        for start in (0, 4, 40)
    )


def engine_side_by_side(threads: int, repeats: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ikcode.engines.base import EngineRequest, SamplingParams
    from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from ikcode.model.loader import load_model

    model = load_model(None)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(17, model.config.vocab_size) for _ in range(n)]  # past the specials

    def engine(gemm: str) -> EmbeddedEngine:
        config = EmbeddedEngineConfig(
            kv_memory_bytes=model.config.kv_bytes_per_token * 4096, num_threads=threads, device="cpu",
            weights="int4", float_weights="fp32", fp32_gemm=gemm,
        )  # fmt: skip
        return EmbeddedEngine(model.config, model.state_dict, config)

    def run(e: EmbeddedEngine, prompts: list[list[int]], tokens: int, temperature: float) -> float:
        for p in prompts:
            sampling = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=temperature)
            e.submit(EngineRequest(uuid.uuid4().hex, p, sampling, cache_salt=uuid.uuid4().hex))
        started = time.perf_counter()
        while e.scheduler.has_work():
            e.step()
        return time.perf_counter() - started

    engines = {"mkl": engine("mkl"), "onednn": engine("onednn")}
    measures = {
        "prefill 512 tok/s": lambda e: 512 / run(e, [prompt(512)], 1, 0.0),
        # 64 tokens less the 1-token run (prefill and first token): the 63 decode steps' time
        "temperature-0 decode tok/s": lambda e: (
            63 / (run(e, [prompt(8)], 64, 0.0) - run(e, [prompt(8)], 1, 0.0))
        ),  # noqa: E501
        "8 x 64 sampled tok/s": lambda e: 8 * 64 / run(e, [prompt(32) for _ in range(8)], 64, 0.2),
    }
    best = {(m, g): 0.0 for m in measures for g in engines}
    for _ in range(repeats):
        for name, measure in measures.items():
            for gemm, e in engines.items():  # in turns: load slows both alike
                best[name, gemm] = max(best[name, gemm], measure(e))
    print(f"\nthe engine, default model, best of {repeats}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'':>28} | {'MKL':>8} | {'oneDNN':>8} | {'ratio':>6}")
    for name in measures:
        mkl, dnn = best[name, "mkl"], best[name, "onednn"]
        print(f"{name:>28} | {mkl:>8.1f} | {dnn:>8.1f} | {dnn / mkl:>5.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,32,128,256,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--engine", action="store_true", help="then the engine, MKL vs oneDNN")
    parser.add_argument("--engine-repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(i, o, generator=g) * 0.02 for i, o in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous()) for w in weights]
    print(f"{args.threads} threads; load average {os.getloadavg()[0]:.2f}")
    print(f"{'rows':>5} | {'MKL ms':>8} {'GFLOP/s':>8} | {'oneDNN ms':>9} {'GFLOP/s':>8} | {'speedup':>7}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, i, generator=g) for i, _ in SHAPES]
        pairs = list(zip(xs, weights, packed, strict=True))
        mkl = seconds_per_pass(lambda: [torch.mm(x, w) for x, w, _ in pairs], args.repeats)  # noqa: B023
        dnn = seconds_per_pass(lambda: [onednn_linear(x, p) for x, _, p in pairs], args.repeats)  # noqa: B023
        flops = 2 * rows * sum(i * o for i, o in SHAPES) * LAYERS
        print(
            f"{rows:>5} | {mkl * 1e3:>8.1f} {flops / mkl / 1e9:>8.1f} | {dnn * 1e3:>9.1f} "
            f"{flops / dnn / 1e9:>8.1f} | {mkl / dnn:>6.2f}x"
        )
    x = torch.randn(512, SHAPES[2][0], generator=g)
    mkl_same = rows_invariant(lambda r: torch.mm(r, weights[2]), x)
    dnn_same = rows_invariant(lambda r: onednn_linear(r, packed[2]), x)
    print(f"a row's bits whatever the rows beside it (1-256 rows): MKL {mkl_same}, oneDNN {dnn_same}")
    if args.engine:
        engine_side_by_side(args.threads, args.engine_repeats)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
