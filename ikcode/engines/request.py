"""What a caller hands an engine: token ids, sampling parameters, cache salt and session hints,
and the synchronous checks every engine's submit() makes on them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ikcode.cache import BlockHash
from ikcode.engines.errors import EmptyPrompt, InvalidSampling, PromptTooLong, TokenOutOfVocab


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 256
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # on top of the model's EOS ids
    ignore_eos: bool = False
    # Penalties on tokens already in the sequence's last `repeat_last_n` tokens (prompt tail
    # included), as llama.cpp and Ollama define them: a repeated token's logit is divided by
    # repeat_penalty (multiplied when negative), then count * frequency_penalty + presence_penalty
    # is subtracted. 1.0 / 0.0 / 0.0 = off. They read token ids only, never the cache.
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def validate(self) -> None:
        if self.max_tokens <= 0:
            raise InvalidSampling(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0):
            raise InvalidSampling(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidSampling(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidSampling(f"top_k must be >= 0, got {self.top_k}")
        if not (self.repeat_penalty > 0.0):
            raise InvalidSampling(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise InvalidSampling(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")

    @property
    def penalized(self) -> bool:
        return self.repeat_last_n > 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )


@dataclass(frozen=True)
class PromptBlockHashes:
    """hash_blocks(prompt, block_size, salt) computed by the caller (the gateway hashes each
    conversation incrementally), so that neither lookup nor the engine thread hashes the prompt
    again. An engine whose block size or salt differs ignores them."""

    block_size: int
    cache_salt: str
    hashes: list[BlockHash]

    def usable(self, num_tokens: int, block_size: int, cache_salt: str) -> bool:
        return (
            self.block_size == block_size
            and self.cache_salt == cache_salt
            and len(self.hashes) == num_tokens // block_size
        )


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Salt mixed into the cache keys: requests with different salts never share cache entries
    # (per-user isolation). "" = the shared namespace.
    cache_salt: str = ""
    session_id: str | None = None
    # The caller expects this session back within seconds (an agent step that may end in a tool
    # call): when the request finishes normally (stop or length, not abort or error), the engine
    # keeps its blocks on the device for up to this many seconds, if its cache policy holds
    # sessions (bounded by the policy's share of the device). None = no hold.
    hold_tail_s: float | None = None
    block_hashes: PromptBlockHashes | None = None


def check_request(request: EngineRequest, max_prompt_tokens: int, vocab_size: int) -> None:
    """The synchronous checks every engine's submit() makes: typed errors with the numbers."""
    prompt = request.prompt_token_ids
    if not prompt:
        raise EmptyPrompt()
    if len(prompt) > max_prompt_tokens:
        raise PromptTooLong(len(prompt), max_prompt_tokens)
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        pos = next(i for i, t in enumerate(prompt) if not 0 <= t < vocab_size)
        raise TokenOutOfVocab(prompt[pos], vocab_size, pos)
    request.sampling.validate()
