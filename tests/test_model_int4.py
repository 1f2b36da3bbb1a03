"""Int4 decode weights: a Q4_1 GGUF's own blocks come back, the kernel multiplies by exactly the
weights `dequantize` describes, a row's result depends on that row only, and the engine serves
batched requests with them."""

from __future__ import annotations

import random

import gguf
import numpy as np
import pytest
import torch

from ikcode.engines.base import EngineRequest, SamplingParams
from ikcode.model import int4, int8, quantized
from tests.tiny_model import assert_pool_clean, tiny_config, tiny_engine, tiny_state_dict

Q4_1_BLOCK_BYTES = 20  # ggml's block_q4_1: fp16 d, fp16 m, 16 bytes of nibbles for 32 weights


def q4_1_codes(tensor) -> np.ndarray:
    """The 4-bit codes of a Q4_1 GGUF tensor, [rows, columns]: in each block, the low nibbles are
    weights 0-15 and the high nibbles weights 16-31 (ggml-quants.c, dequantize_row_q4_1)."""
    blocks = np.asarray(tensor.data).reshape(tensor.data.shape[0], -1, Q4_1_BLOCK_BYTES)[..., 4:]
    return np.concatenate([blocks & 0x0F, blocks >> 4], axis=-1).reshape(tensor.data.shape[0], -1)


def test_the_default_models_q4_1_blocks_come_back_as_its_own_codes(default_model):
    tensor = next(
        t for t in gguf.GGUFReader(default_model.source).tensors if t.name == "blk.0.ffn_down.weight"
    )
    assert tensor.tensor_type.name == "Q4_1"
    weight = default_model.state_dict["model.layers.0.mlp.down_proj.weight"]  # [out, in], fp32
    codes, pairs = int4.quantize(weight.t())
    assert np.array_equal(codes.numpy(), q4_1_codes(tensor))
    # What moves is the scale and minimum, rounded from fp16 to bf16: well under a step.
    steps = pairs[..., 0].float().t().repeat_interleave(int4.GROUP, dim=1)  # [out, in]
    moved = (int4.dequantize(codes, pairs).t() - weight).abs()
    assert (moved / steps).max() < 0.1


def test_the_kernel_multiplies_by_the_dequantized_weights_row_by_row():
    g = torch.Generator().manual_seed(0)
    weight_t, bias = torch.randn(96, 80, generator=g), torch.randn(80, generator=g)
    packed = int4.pack(weight_t, bias)
    x = torch.randn(9, 96, generator=g)
    x[3] *= 100  # an outlier row changes nothing for the others: activations are not quantized
    codes, pairs = int4.quantize(weight_t)
    exact = x.bfloat16().float() @ int4.dequantize(codes, pairs) + bias
    out = packed.linear(x)
    # The kernel accumulates in fp32 and writes bf16: 2^-9 relative, plus the order of the sums.
    assert ((out - exact).abs() / exact.abs().amax(dim=1, keepdim=True)).max() < 2**-8
    for rows in ([5], [1, 2], [0, 1, 2, 3], [8, 3, 0, 6, 2]):
        alone = packed.linear(x[rows])
        for i, row in enumerate(rows):
            assert torch.equal(alone[i], out[row]), f"row {row} changed with the batch {rows}"


def test_a_matrix_int4_cannot_group_falls_back_to_int8():
    for shape in ((40, 16), (32, 24)):
        assert isinstance(quantized.pack("int4", torch.randn(shape)), int8.Int8Weight)
        with pytest.raises(ValueError, match="whole groups of 32"):
            int4.pack(torch.randn(shape))
    with pytest.raises(ValueError, match="int8 or int4"):
        quantized.pack("int3", torch.randn(32, 16))  # type: ignore[arg-type]


def four_bit_weights(architecture: str) -> dict[str, torch.Tensor]:
    """The tiny model's weights with every matrix int4 can pack already on the 4-bit grid, as a
    Q4_1 GGUF's are: int4 then differs from fp32 only by its bf16 rounding."""
    weights = tiny_state_dict(tiny_config(architecture, False), 0)
    for name, w in weights.items():
        if w.dim() == 2 and "embed" not in name and int4.fits(w.t()):
            weights[name] = int4.dequantize(*int4.quantize(w.t())).t().contiguous()
    return weights


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # qwen2: q/k/v with a bias
def test_engine_with_int4_weights_serves_concurrent_streams(monkeypatch, architecture: str):
    calls = []
    real_linear = int4.Int4Weight.linear
    monkeypatch.setattr(int4.Int4Weight, "linear", lambda w, x: calls.append(len(x)) or real_linear(w, x))
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 60))] for _ in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)  # greedy, so comparable
    fp32 = tiny_engine(architecture, batch_invariance="off", state_dict=four_bit_weights(architecture))
    expected = [fp32.submit(EngineRequest(f"f{i}", p, params)).collect(30)[0] for i, p in enumerate(prompts)]
    fp32.shutdown()
    engine = tiny_engine(
        architecture,
        batch_invariance="off",
        weights="int4",
        start=False,
        max_num_seqs=8,
        state_dict=four_bit_weights(architecture),
    )
    int8_engine = tiny_engine(architecture, weights="int8", start=False)
    int8_bytes = int8_engine.runner.quantized_weight_bytes
    int8_engine.shutdown()
    assert 0 < engine.runner.quantized_weight_bytes < int8_bytes
    streams = [engine.submit(EngineRequest(f"q{i}", p, params)) for i, p in enumerate(prompts)]
    engine.start()
    got = [s.collect(30)[0] for s in streams]
    assert max(engine.batch_sizes) == len(prompts)
    # The decode rows went through the 4-bit weights (four matmuls a layer), all six at once.
    assert len(calls) >= 4 * 23 and max(calls) == len(prompts)
    assert all(len(tokens) == 24 for tokens in got)
    same = sum(a == b for x, y in zip(got, expected, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.5 * 24 * len(prompts), f"int4 agrees with fp32 on only {same} tokens"
    assert_pool_clean(engine)
    engine.shutdown()
