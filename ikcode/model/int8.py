"""Int8 weights for decode matmuls, kept quantized: x @ W through fbgemm's int8 GEMM.

A decode step is a chain of few-row matmuls bound by how many weight bytes it reads; int8 reads a
quarter of fp32's. Weights are quantized once per output channel, symmetric (scale = max |w| /
127, as torch's `default_per_channel_weight_observer`) and packed for fbgemm
(`quantized::linear_prepack`); each call quantizes its activations asymmetrically over their
[min, max] (after SiLU or a norm, rows are skewed: a symmetric scale wastes half the range,
measured perplexity 11.2 vs 10.0, fp32 9.0), multiplies in int8 with int32 accumulation and
rescales to fp32, in one fused kernel (`quantized::linear_dynamic`).

Why each row gets its own activation scale: the rows of a batched decode step belong to
different sequences, and LLM activations have outlier tokens. fbgemm takes one activation scale
per call, so one sequence's outlier would coarsen every other row (on SmolLM2-135M, 8-row groups
raised the perplexity of a fixed text from 9.00 to 13.4). So a call of several rows first maps
each row onto [-1, 1] by its own centre and half-range (x = centre + half * x_n, exact per row),
and a constant row holding -1 and 1 goes first: fbgemm's one scale is then exactly every row's
own [min, max] scale whatever else is in the batch, and W x = half * (W x_n) + centre * sum_in W.
This replaced per-row quantization by hand around `torch._int_mm`: SmolLM2-135M's 30 layers'
matmuls at 8 rows, one thread, 14.1 ms -> 9.9 ms; the same error against fp32.

Activations keep all 8 bits where the CPU has avx512_vnni (vpdpbusd sums u8 x s8 products in
int32); elsewhere fbgemm sums pairs of products in int16, which can saturate, so they keep 7
(`reduce_range`, as torch.ao's dynamic Linear passes it). Measured: a row's relative error
against fp32 ~1.4% with 8 bits, ~2.3% with 7.

A row's result depends only on that row, but the int8 numbers differ from fp32: batch-invariant
rows keep the float weights (fp32 or bf16).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

# torch/cpu/__init__.py `_is_vnni_supported`: whether the CPU has avx512_vnni.
REDUCE_RANGE = not torch.cpu._is_vnni_supported()


@dataclass
class Int8Weight:
    fbgemm: torch.ScriptObject  # int8 [out, in] per-channel weights packed for fbgemm, no bias
    column_sums: torch.Tensor  # fp32 [out]: sum over `in` of the dequantized weight
    bias: torch.Tensor | None  # fp32 [out]
    nbytes: int  # what the int8 copy takes (weights, scales, sums, bias)
    calibration: torch.Tensor  # fp32 [1, in]: -1, 1, then zeros (the first row of a batched call)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self)


def pack(weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Weight:
    """Int8 copy of an [in, out] fp32 matrix (+ fp32 bias)."""
    weight_t = weight_t.detach().float()
    scale = (weight_t.abs().amax(dim=0) / 127.0).clamp_min(1e-12)
    weight = torch.round(weight_t / scale).clamp_(-127, 127).to(torch.int8)
    column_sums = (weight.sum(dim=0, dtype=torch.int64).double() * scale.double()).float()
    bias = None if bias is None else bias.detach().float().clone()
    with warnings.catch_warnings():
        # torch 2.13 flags quantized tensor creation as deprecated; torch is pinned exactly.
        warnings.simplefilter("ignore", UserWarning)
        zero_points = torch.zeros(scale.shape[0], dtype=torch.long)
        qweight = torch._make_per_channel_quantized_tensor(
            weight.t().contiguous(), scale.double(), zero_points, 0
        )
    nbytes = weight.nbytes + scale.nbytes + column_sums.nbytes + (0 if bias is None else bias.nbytes)
    calibration = torch.zeros(1, weight_t.shape[0])
    calibration[0, :2] = torch.tensor([-1.0, 1.0])
    packed = torch.ops.quantized.linear_prepack(qweight, None)
    return Int8Weight(packed, column_sums, bias, nbytes, calibration)


def linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x @ W (+ bias) for fp32 x [rows, in], activations quantized per row."""
    if x.shape[0] == 1:  # one row: fbgemm's own [min, max] is the row's
        out = torch.ops.quantized.linear_dynamic(x.contiguous(), w.fbgemm, reduce_range=REDUCE_RANGE)
    else:
        # Few ops on purpose: at 8 rows each costs about as much as a tenth of the matmul.
        low, high = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
        centre = torch.lerp(low, high, 0.5)
        half = torch.sub(high, centre).clamp_min_(1e-12)
        unit = torch.sub(x, centre).div_(half).clamp_(-1.0, 1.0)
        rows = torch.cat((w.calibration, unit))
        out = torch.ops.quantized.linear_dynamic(rows, w.fbgemm, reduce_range=REDUCE_RANGE)[1:]
        out = torch.addcmul(centre * w.column_sums, out, half)
    return out if w.bias is None else out.add_(w.bias)
