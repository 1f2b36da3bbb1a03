"""4-bit weights for decode matmuls, kept 4-bit: x @ W through torch's CPU int4 GEMM.

A decode step is a chain of few-row matmuls bound by how many weight bytes it reads: 4 bits plus
a bf16 scale and zero per 32 weights, 5 bits a weight, read 5/8 of int8's bytes. Weights are quantized in
groups of GROUP consecutive input channels per output channel, asymmetric over the group's
[min, max] (15 steps), the way a GGUF's Q4_1 blocks are: for the default model, whose weights
arrive as Q4_1 blocks of 32, quantizing the dequantized blocks gives back their own codes (the
block's min and max are two of its values), and only the scale and the minimum are rounded, from
fp16 to bf16 (tests/test_model_int4.py).

The kernel (`aten::_weight_int4pack_mm_for_cpu`; pytorch 00b919a,
aten/src/ATen/native/cpu/int4mm_kernel.cpp, `tinygemm_kernel`; its packing refuses an `out` that is
not a multiple of 16) takes bf16 activations and bf16 (scale, zero) pairs laid out [in / GROUP,
out, 2], dequantizes each weight as (code - 8) * scale + zero in fp32, accumulates in fp32 and
writes bf16. So zero = min + 8 * scale. With fp32 activations it falls back to a scalar loop
(~40x slower here), hence the bf16 round trip. Activations are not quantized: the error against
fp32 is the activations' and outputs' bf16 rounding (2^-9 relative) on top of the weights'
4 bits. Each row is computed on its own (fp32 accumulation in the same order whatever the row
count), but rows still go through int4 only where they may vary with the batch (see llama.py):
batch-invariant rows keep the float weights (fp32 or bf16).

Measured on matmuls of SmolLM2-135M's shapes (a step's 121, two threads, weights streamed from
memory as in a step): one row 3.6 ms vs int8's 5.0 ms; eight rows 8.0 ms vs 9.5 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # input channels per (scale, zero) pair: a GGUF Q4_1 / Q4_0 block


@dataclass
class Int4Weight:
    codes: torch.Tensor  # uint8 [out, in / 2], packed by torch for its CPU kernel
    scales_and_zeros: torch.Tensor  # bf16 [in / GROUP, out, 2]
    bias: torch.Tensor | None  # fp32 [out]
    nbytes: int

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W (+ bias) for fp32 x [rows, in]; fp32 out."""
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16).contiguous(),  # the kernel takes only contiguous bf16
            self.codes,
            GROUP,
            self.scales_and_zeros,
        ).float()
        return out if self.bias is None else out.add_(self.bias)


def fits(weight_t: torch.Tensor) -> bool:
    """Whether an [in, out] matrix can be packed: whole groups along `in`, and `out` a multiple of
    16 (`_convert_weight_to_int4pack_cpu` refuses other shapes)."""
    return weight_t.shape[0] % GROUP == 0 and weight_t.shape[1] % 16 == 0


def quantize(weight_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int32 [out, in] in 0..15, bf16 (scale, zero) pairs [in / GROUP, out, 2]) of an
    [in, out] matrix. The pairs are rounded to bf16 first and the codes taken against the rounded
    pairs, so the rounding moves no weight by more than half a step plus what clamping costs."""
    weight = weight_t.detach().float().t()
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp_min(1e-12)
    pairs = torch.stack((scale.t(), (low + 8.0 * scale).t()), dim=-1).to(torch.bfloat16).contiguous()
    scale, zero = pairs[..., 0].float().t().unsqueeze(-1), pairs[..., 1].float().t().unsqueeze(-1)
    codes = torch.round((groups - zero) / scale + 8.0).clamp_(0, 15)
    return codes.to(torch.int32).reshape(out_features, in_features), pairs


def dequantize(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The [in, out] fp32 matrix the kernel multiplies by, from `quantize`'s output (the kernel's
    own formula; for tests and error reports)."""
    out_features, in_features = codes.shape
    scale, zero = scales_and_zeros[..., 0].float().t(), scales_and_zeros[..., 1].float().t()
    grouped = codes.float().reshape(out_features, in_features // GROUP, GROUP) - 8.0
    return (grouped * scale.unsqueeze(-1) + zero.unsqueeze(-1)).reshape(out_features, in_features).t()


def pack(weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Weight:
    """4-bit copy of an [in, out] fp32 matrix (+ fp32 bias); `fits(weight_t)` must hold."""
    if not fits(weight_t):
        raise ValueError(
            f"int4 weights need input channels in whole groups of {GROUP} and output channels in 16s, "
            f"got [in, out] = {list(weight_t.shape)}"
        )
    codes, pairs = quantize(weight_t)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)  # inner k tiles: unused on CPU
    bias = None if bias is None else bias.detach().float().clone()
    nbytes = packed.nbytes + pairs.nbytes + (0 if bias is None else bias.nbytes)
    return Int4Weight(packed, pairs, bias, nbytes)
