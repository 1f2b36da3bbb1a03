"""The decoder layers' fp32 matmuls through MKL (`torch.mm` on [in, out] weights) vs oneDNN
(`mkldnn._linear_pointwise` on weights packed by `mkldnn._reorder_linear_weight`), side by side.

    .venv/bin/python bench/onednn_matmul.py [--rows 1,4,32,128,256,512] [--threads 2] [--repeats 10]

Shapes: the default model's (SmolLM2-135M: qkv 576x960, o 576x576, gate_up 576x3072, down
1536x576), each layer's four matmuls run for --repeats passes, times 30 layers, on random
weights (the speed does not depend on the values). The engine packs its fp32 weights for oneDNN
(LlamaModel.pack_for_onednn); the row counts are those it runs: 1-8 decode rows, prompt chunks.
Also checked: a row's bits do not depend on how many rows share the call, for oneDNN as for MKL
(the engine's batch invariance rests on it; tests/test_engine_determinism.py checks the outcome).
"""

from __future__ import annotations

import argparse
import os
import time

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,32,128,256,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
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
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
