"""Int8 weights for decode matmuls, kept quantized: x @ W as an int8 x int8 -> int32 matmul.

A decode step is a chain of few-row matmuls bound by how many weight bytes it reads; int8 reads a
quarter of fp32's. Weights are quantized once per output channel, symmetric (scale = max |w| /
127, as torch's `default_per_channel_weight_observer`); each call quantizes its activations per
row (one scale per token), multiplies with `torch._int_mm` (int32 accumulation: nothing
saturates) and rescales to fp32.

Why per row: the rows of a batched decode step belong to different sequences, and LLM activations
have outlier tokens. fbgemm's dynamic linear (`torch.ops.quantized.linear_dynamic`) takes one
activation scale for the whole call, so one sequence's outlier coarsens every other row: on
SmolLM2-135M, 8-row groups raised the perplexity of a fixed text from 9.00 (fp32) to 13.4;
per-row scales give about 10.0 (bench/quantized_quality.py).

A single row takes fbgemm's dynamic linear, whose one scale per call is then per row: one fused
kernel instead of a dozen small ops. Measured on this machine (AVX512-VNNI, one thread, loaded),
SmolLM2-135M's 30 layers' matmuls plus the output layer per decode step: fp32 [in, out] 81 / 215 /
201 ms at 1 / 4 / 8 rows; fbgemm 21 ms at 1 row; the per-row path about 53 ms at 1, 4 or 8 rows.

A row's result depends only on that row (its own scale), but the int8 numbers differ from fp32:
batch-invariant rows keep the fp32 weights.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


@dataclass
class Int8Weight:
    weight: torch.Tensor  # int8 [in, out]
    scale: torch.Tensor  # fp32 [out]: per output channel
    bias: torch.Tensor | None  # fp32 [out]
    column_sums: torch.Tensor  # int32 [out]: sum over `in` of the int8 weight (zero-point term)
    fbgemm: torch.ScriptObject  # the same weights packed for fbgemm (one-row calls)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.weight, self.scale, self.bias) if t is not None)


def pack(weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Weight:
    """Int8 copy of an [in, out] fp32 matrix (+ fp32 bias)."""
    weight_t = weight_t.detach().float()
    scale = (weight_t.abs().amax(dim=0) / 127.0).clamp_min(1e-12)
    weight = torch.round(weight_t / scale).clamp_(-127, 127).to(torch.int8).contiguous()
    bias = None if bias is None else bias.detach().float().clone()
    with warnings.catch_warnings():
        # torch 2.13 flags quantized tensor creation as deprecated; torch is pinned exactly.
        warnings.simplefilter("ignore", UserWarning)
        zero_points = torch.zeros(scale.shape[0], dtype=torch.long)
        qweight = torch._make_per_channel_quantized_tensor(
            weight.t().contiguous(), scale.double(), zero_points, 0
        )
    fbgemm = torch.ops.quantized.linear_prepack(qweight, bias)
    return Int8Weight(weight, scale, bias, weight.sum(dim=0, dtype=torch.int32), fbgemm)


def linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x @ W (+ bias) for fp32 x [rows, in], activations quantized per row.

    Asymmetric (x ~ (q - zero) * scale over the row's [min, max]), as fbgemm quantizes
    activations: after SiLU or a norm, rows are skewed, and a symmetric scale wastes half the
    range (measured: perplexity 11.2 symmetric vs 10.0 asymmetric, fp32 9.0)."""
    if x.shape[0] == 1:
        # reduce_range keeps fbgemm's 16-bit pair sums from saturating on CPUs without VNNI, as
        # torch.ao.nn.quantized.dynamic.Linear.forward passes it.
        return torch.ops.quantized.linear_dynamic(x.contiguous(), w.fbgemm, reduce_range=True)
    low = x.amin(dim=1, keepdim=True).clamp_max_(0.0)
    high = x.amax(dim=1, keepdim=True).clamp_min_(0.0)
    x_scale = (high - low).clamp_min_(1e-12).div_(255.0)
    zero = torch.round(-low / x_scale).sub_(128.0)  # q = round(x / scale) + zero, in [-128, 127]
    xq = torch.round(x / x_scale).add_(zero).clamp_(-128, 127).to(torch.int8)
    acc = torch._int_mm(xq, w.weight).float()
    out = acc.sub_(zero * w.column_sums).mul_(x_scale).mul_(w.scale)
    return out if w.bias is None else out.add_(w.bias)
