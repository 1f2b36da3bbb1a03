"""Next-token choice: greedy at temperature 0, else temperature / top-k / top-p with the request's
own seeded generator (so a seeded request samples the same tokens whatever else runs)."""

from __future__ import annotations

import torch

from ikcode.engines.base import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] fp32 for one sequence."""
    if params.temperature <= 0 or generator is None:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the tokens before it already cover top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
