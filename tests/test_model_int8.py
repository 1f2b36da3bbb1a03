"""Int8 decode weights: each row's result depends on that row only, stays close to fp32, and the
engine serves batched requests with them."""

from __future__ import annotations

import random

import torch

from ikcode.engines.base import EngineRequest, SamplingParams
from ikcode.model import int8
from tests.tiny_model import assert_pool_clean, tiny_engine


def test_rows_are_quantized_independently_and_stay_close():
    g = torch.Generator().manual_seed(0)
    weight_t, bias = torch.randn(64, 96, generator=g), torch.randn(96, generator=g)
    packed = int8.pack(weight_t, bias)
    x = torch.randn(8, 64, generator=g)
    x[3] *= 100  # an outlier token: with one scale per call it would coarsen every other row
    exact = x @ weight_t + bias
    out = int8.linear(x, packed)
    for row in (0, 5):
        error = (out[row] - exact[row]).abs().max() / exact[row].abs().max()
        assert error < 0.02, f"row {row}: relative error {error:.3f}"
    alone = int8.linear(x[5:6], packed)  # one row: fbgemm's kernel
    assert (alone[0] - exact[5]).abs().max() / exact[5].abs().max() < 0.03
    assert torch.equal(int8.linear(x[:4], packed)[1], int8.linear(x[1:3], packed)[0])


def test_a_rows_result_is_bit_for_bit_the_same_in_any_batch():
    """fbgemm takes one activation scale per call; each row is mapped onto [-1, 1] first, and the
    scale must come out the same whatever rows share the call (a row's last bits included)."""
    g = torch.Generator().manual_seed(1)
    packed = int8.pack(torch.randn(96, 80, generator=g))
    # Rows off centre: most map their [min, max] onto [-1, 1] only to within a rounding.
    x = torch.randn(12, 96, generator=g) * torch.rand(12, 1, generator=g) * 10
    x += torch.randn(12, 1, generator=g) * 20
    full = int8.linear(x, packed)
    rng = random.Random(0)
    for _ in range(40):
        rows = rng.sample(range(12), rng.randrange(2, 12))
        out = int8.linear(x[rows], packed)
        for i, row in enumerate(rows):
            assert torch.equal(out[i], full[row]), f"row {row} changed with the batch {rows}"


def test_engine_with_int8_weights_serves_concurrent_streams():
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 60))] for _ in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)  # greedy, so comparable
    fp32 = tiny_engine(batch_invariance="off")
    expected = [fp32.submit(EngineRequest(f"f{i}", p, params)).collect(30)[0] for i, p in enumerate(prompts)]
    fp32.shutdown()
    engine = tiny_engine(batch_invariance="off", weights="int8", start=False, max_num_seqs=8)
    assert engine.runner.quantized_weight_bytes > 0
    streams = [engine.submit(EngineRequest(f"q{i}", p, params)) for i, p in enumerate(prompts)]
    engine.start()
    got = [s.collect(30)[0] for s in streams]
    assert max(engine.batch_sizes) == len(prompts)
    assert all(len(tokens) == 24 for tokens in got)
    same = sum(a == b for x, y in zip(got, expected, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.5 * 24 * len(prompts), f"int8 agrees with fp32 on only {same} tokens"
    assert_pool_clean(engine)
    engine.shutdown()
