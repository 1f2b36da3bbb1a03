"""What comes back from an engine besides the stream itself: token and lifecycle events, per-request
stats, cache lookups, and the engine's static info and current load.

The lifecycle matters for caching: `finished` (the last token came out) is not `released`
(the engine gave the sequence's KV back). Prefix-cache entries are committed on release.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from ikcode.engines.errors import EngineError


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # see TokenEvent.error


@dataclass
class RequestStats:
    """Per-request truth: where the prompt came from and when things happened (monotonic s)."""

    prompt_tokens: int = 0
    cached_tokens_device: int = 0
    cached_tokens_host: int = 0
    computed_tokens: int = 0
    output_tokens: int = 0
    queued_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    released_at: float | None = None

    @property
    def cached_tokens(self) -> int:
        return self.cached_tokens_device + self.cached_tokens_host

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.queued_at

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.queued_at


@dataclass
class TokenEvent:
    """One or more new tokens of one request; the last event has finished=True."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None  # set on the first-token event and on the final event
    error: EngineError | None = None


class LifecycleKind(StrEnum):
    ADMITTED = "admitted"  # entered the running batch; its cache lookup is final
    FIRST_TOKEN = "first_token"
    FINISHED = "finished"  # last token produced; the engine may still hold the KV
    RELEASED = "released"  # the engine gave the KV back: the moment to commit cache entries


@dataclass(frozen=True)
class LifecycleEvent:
    kind: LifecycleKind
    request_id: str
    at: float
    stats: RequestStats | None = None


LifecycleListener = Callable[[LifecycleEvent], None]


@dataclass(frozen=True)
class CacheLookup:
    """How much of a prompt an engine could serve from its cache right now (no side effects)."""

    prompt_tokens: int
    device_tokens: int = 0
    host_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        return self.device_tokens + self.host_tokens

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    context_window: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    kind: str  # "embedded", "deepinfer", "upstream", "simulated"
    device: str = "cpu"


@dataclass
class EngineLoad:
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0  # referenced by running sequences
    kv_blocks_cached: int = 0  # unreferenced but holding a committed prefix
    host_blocks_total: int = 0
    host_blocks_used: int = 0
