"""An online estimate of the server's prefill rate (tokens/s), for predicting TTFT."""

from __future__ import annotations


class PrefillRateEstimator:
    """EMA of measured prefill throughput, seeded by the profile's figure.

    A sample is one completed prefill: tokens computed / (first token - admitted), multiplied by
    the number of prefills that shared the engine with it (they split its capacity), so that the
    estimate is the whole server's rate, not one request's slice of it.
    """

    def __init__(self, prior_tokens_per_s: float = 0.0, alpha: float = 0.2, min_tokens: int = 4096):
        self.tokens_per_s = prior_tokens_per_s
        self.alpha = alpha
        self.min_tokens = min_tokens
        self.samples = 0

    def observe(self, computed_tokens: int, seconds: float, sharing: int = 1) -> None:
        if computed_tokens < self.min_tokens or seconds <= 0:
            return
        sample = computed_tokens * max(1, sharing) / seconds
        if self.tokens_per_s <= 0:
            self.tokens_per_s = sample
        else:
            self.tokens_per_s += self.alpha * (sample - self.tokens_per_s)
        self.samples += 1

    @property
    def known(self) -> bool:
        return self.tokens_per_s > 0

    def seconds_for(self, tokens: float) -> float:
        return tokens / self.tokens_per_s if self.tokens_per_s > 0 else 0.0
