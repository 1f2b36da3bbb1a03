"""The one interface every engine implements (embedded, deepinfer, upstream, simulated).

The gateway and the admission layer talk only to this. Engines do not know HTTP.

A request goes in as token ids; tokens come back as a `RequestStream` that can be read from
a plain thread (`for event in stream`) or from asyncio (`async for event in stream`), because
engines run their step loop on a thread of their own and the gateway lives on an event loop.

The lifecycle matters for caching: `finished` (the last token came out) is not `released`
(the engine gave the sequence's KV back). Prefix-cache entries are committed on release.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from ikcode.cache import BlockHash
from ikcode.model.errors import ModelLoadError  # noqa: F401  (the model layer's; re-exported)


# ---------------------------------------------------------------------------------------------
# Errors raised at the engine boundary: typed, with the numbers, never a crash of the engine
# thread. The gateway maps them to Anthropic error shapes.
# ---------------------------------------------------------------------------------------------
class EngineError(Exception):
    """Base class of every error an engine reports for one request."""


class PromptTooLong(EngineError):
    def __init__(self, prompt_tokens: int, max_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        # This wording is what Claude Code looks for to trigger its own compaction.
        super().__init__(f"prompt is too long: {prompt_tokens} tokens > {max_tokens} maximum")


class EmptyPrompt(EngineError):
    def __init__(self) -> None:
        super().__init__("prompt is empty: at least one token is required")


class TokenOutOfVocab(EngineError):
    def __init__(self, token_id: int, vocab_size: int, position: int):
        self.token_id = token_id
        self.vocab_size = vocab_size
        self.position = position
        super().__init__(
            f"token id {token_id} at position {position} is outside the vocabulary [0, {vocab_size})"
        )


class InvalidSampling(EngineError):
    """A sampling parameter out of range (max_tokens <= 0, top_p outside (0, 1], ...)."""


class EngineOverloaded(EngineError):
    """The engine cannot take the request now (no KV memory, queue full). Retryable."""

    def __init__(self, message: str, retry_after_s: int = 5):
        self.retry_after_s = retry_after_s
        super().__init__(message)


class EngineShutdown(EngineError):
    def __init__(self) -> None:
        super().__init__("engine is shutting down")


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# What comes back
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# The stream a caller reads, fed by the engine thread
# ---------------------------------------------------------------------------------------------
_END = object()


class RequestStream:
    """Thread-safe hand-off of TokenEvents from an engine thread to one reader.

    The engine calls `put(event)`; a reader iterates synchronously or asynchronously. The stream
    ends after the event with finished=True. `abort()` asks the engine to stop the request; the
    engine still delivers a final event (finish_reason=ABORT) so that nothing is left open.
    """

    def __init__(self, request_id: str, on_abort: Callable[[str], None] | None = None):
        self.request_id = request_id
        self._q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._on_abort = on_abort
        self._closed = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aq: asyncio.Queue[object] | None = None
        self._lock = threading.Lock()
        self.final: TokenEvent | None = None

    # -- engine side --------------------------------------------------------------------------
    def put(self, event: TokenEvent) -> None:
        if self._closed.is_set():
            return
        if event.finished:
            self.final = event
            self._closed.set()
        # Under the lock: an async reader attaching between our look at _loop and a put into
        # _q would drain _q first and then never see this event.
        with self._lock:
            loop, aq = self._loop, self._aq
            if loop is None or aq is None:
                self._q.put(event)
                return
        try:
            loop.call_soon_threadsafe(aq.put_nowait, event)
        except RuntimeError:  # the reader's loop is gone; nobody is listening
            pass

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # -- reader side --------------------------------------------------------------------------
    def abort(self) -> None:
        if self._on_abort is not None and not self._closed.is_set():
            self._on_abort(self.request_id)

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            event = self._q.get()
            assert isinstance(event, TokenEvent)
            yield event
            if event.finished:
                return

    def collect(self, timeout_s: float | None = None) -> tuple[list[int], TokenEvent]:
        """Read to the end; return all token ids and the final event (tests, simple callers)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        tokens: list[int] = []
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                event = self._q.get(timeout=remaining)
            except queue.Empty:
                self.abort()
                raise TimeoutError(f"request {self.request_id} did not finish in {timeout_s} s") from None
            assert isinstance(event, TokenEvent)
            tokens.extend(event.token_ids)
            if event.finished:
                return tokens, event

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        aq: asyncio.Queue[object] = asyncio.Queue()
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._aq = aq
            # Events that arrived before the reader attached.
            while True:
                try:
                    aq.put_nowait(self._q.get_nowait())
                except queue.Empty:
                    break
        while True:
            event = await aq.get()
            assert isinstance(event, TokenEvent)
            yield event
            if event.finished:
                return


# ---------------------------------------------------------------------------------------------
# The protocol
# ---------------------------------------------------------------------------------------------
@runtime_checkable
class Engine(Protocol):
    """What the gateway and admission layer need from an engine."""

    @property
    def info(self) -> EngineInfo: ...

    def start(self) -> None:
        """Start the engine thread(s). Idempotent."""

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking requests, let running ones finish (up to the timeout), abort the rest."""

    def submit(self, request: EngineRequest) -> RequestStream:
        """Queue a request. Raises an EngineError subclass for bad input, synchronously."""

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream gets a final event with finish_reason=ABORT."""

    def lookup(
        self, prompt_token_ids: list[int], cache_salt: str = "", block_hashes: PromptBlockHashes | None = None
    ) -> CacheLookup:
        """How much of this prompt is cached now, by tier. No side effects."""

    def load(self) -> EngineLoad: ...

    def add_listener(self, listener: LifecycleListener) -> None:
        """Receive lifecycle events (called on the engine thread: keep it short)."""
