"""Int8 weights for decode matmuls, kept quantized: fbgemm's dynamic-quantized linear.

A decode step is a chain of few-row matmuls bound by how many weight bytes it reads; int8 reads a
quarter of fp32's. fbgemm (x86, AVX2/AVX512-VNNI) quantizes each call's activations on the fly
(one scale per call) and multiplies int8 by int8 with an fp32 result. Measured on this machine's
AVX512-VNNI cores, one thread, the 30 layers' matmuls plus the output layer of SmolLM2-135M:
fp32 [in, out] 81 / 215 / 201 ms at 1 / 4 / 8 rows, int8 21 / 26 / 29 ms.

Weights are quantized per output channel, symmetric (scale = max |w| / 127), as torch's own
`default_per_channel_weight_observer` does. `reduce_range=True` quantizes activations to 7 bits,
as `torch.ao.nn.quantized.dynamic.Linear.forward` does (it keeps fbgemm's 16-bit intermediate
sums from saturating on CPUs without VNNI).

Because the activation scale is taken over all rows of a call, a row's result depends on the rows
beside it: the int8 path is never batch-invariant, so batch-invariant rows keep fp32 weights.
"""

from __future__ import annotations

import warnings

import torch


def pack(weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.ScriptObject:
    """fbgemm-packed int8 weight of an [in, out] fp32 matrix (+ fp32 bias)."""
    weight = weight_t.detach().t().contiguous().float()  # fbgemm wants [out, in]
    scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
    zero_point = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # torch 2.13 flags quantized tensor creation as deprecated; torch is pinned exactly.
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch.quantize_per_channel(weight, scale, zero_point, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())


def linear(x: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
    """x @ W (+ bias) with the packed int8 W; x fp32 [rows, in]."""
    return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, reduce_range=True)


def packed_bytes(weight_t: torch.Tensor) -> int:
    """Bytes an int8 copy of weight_t takes (weights plus per-channel fp32 scales)."""
    return weight_t.numel() + 4 * weight_t.shape[1]
