"""sample_rows, a step's rows sampled at once, picks exactly the tokens sample() picks row by row:
same seeds, same draws, whatever the mix of greedy, plain-temperature, top-k, top-p and penalized
rows beside each other."""

from __future__ import annotations

import pytest
import torch

from ikcode.engines.base import SamplingParams
from ikcode.engines.embedded.sampler import sample, sample_rows

MIX = [
    SamplingParams(temperature=0.2, seed=1),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, seed=2),
    SamplingParams(temperature=1.0, top_k=40, seed=3),
    SamplingParams(temperature=0.9, top_p=0.9, seed=4),
    SamplingParams(temperature=0.5, repeat_penalty=1.3, frequency_penalty=0.2, seed=5),
    SamplingParams(temperature=1.3, top_k=100_000, seed=6),  # top_k past the vocabulary: plain
    SamplingParams(temperature=0.2, seed=1),  # the same seed as row 0, its own generator
]


def generators(params: list[SamplingParams]) -> list[torch.Generator | None]:
    return [
        torch.Generator().manual_seed(p.seed) if p.temperature > 0 and p.seed is not None else None
        for p in params
    ]


@pytest.mark.parametrize("vocab", [50, 49_152])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_rows_at_once_pick_the_tokens_of_rows_one_by_one(vocab: int, rows: int):
    params = MIX[:rows] if rows > 1 else [MIX[2]]
    gen_rows, gen_one = generators(params), generators(params)
    history = [[3, 3, 7, 11, 3, 20][: 2 + i] for i in range(rows)]
    picked_rows, picked_one = [], []
    for step in range(25):  # the generators advance together, draw by draw
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(step)) * 4
        picked_rows.append(sample_rows(logits, params, gen_rows, history))
        picked_one.append([sample(logits[i], params[i], gen_one[i], history[i]) for i in range(rows)])
    assert picked_rows == picked_one
    if vocab > 50 and rows > 1:
        assert len({tuple(r) for r in picked_rows}) > 1  # the draws really vary from step to step


def test_a_tie_heavy_row_still_matches_and_stays_in_the_vocabulary():
    # All the mass on the last token: the cumulative sum's right edge is where a clamp matters.
    logits = torch.full((2, 64), -1e4)
    logits[:, -1] = 0.0
    params = [SamplingParams(temperature=0.8, seed=9), SamplingParams(temperature=0.8, seed=10)]
    tokens = sample_rows(logits, params, generators(params), [[], []])
    assert tokens == [63, 63]
    assert tokens == [sample(logits[i], params[i], g) for i, g in enumerate(generators(params))]
