"""Quantized copies of the matmul weights, read by the decode rows that may vary with the batch
(llama.py): which kinds there are and how one is built. Every other row reads the float
weights (fp32, or bf16: LlamaModel.matmul_weights_to)."""

from __future__ import annotations

from typing import Literal, Protocol, get_args

import torch

from ikcode.model import int4, int8

Kind = Literal["int8", "int4"]
KINDS: tuple[Kind, ...] = get_args(Kind)


class QuantizedWeight(Protocol):
    nbytes: int  # what the copy takes

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W (+ bias) for fp32 x [rows, in]; fp32 out."""
        ...


def pack(kind: Kind, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> QuantizedWeight:
    """A `kind` copy of an [in, out] fp32 matrix (+ bias). A matrix int4 cannot pack
    (int4.fits: input channels in whole groups, output channels in 16s) gets int8."""
    if kind == "int4" and int4.fits(weight_t):
        return int4.pack(weight_t, bias)
    if kind in KINDS:
        return int8.pack(weight_t, bias)
    raise ValueError(f"quantized weights are {' or '.join(KINDS)}, got {kind!r}")
