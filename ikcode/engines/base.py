"""The one interface every engine implements (embedded, deepinfer, upstream, simulated).

The gateway and the admission layer talk only to this. Engines do not know HTTP.

A request goes in as token ids; tokens come back as a `RequestStream` that can be read from
a plain thread (`for event in stream`) or from asyncio (`async for event in stream`), because
engines run their step loop on a thread of their own and the gateway lives on an event loop.

The lifecycle matters for caching: `finished` (the last token came out) is not `released`
(the engine gave the sequence's KV back). Prefix-cache entries are committed on release.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

# The types the protocol speaks in live in their own modules; they are re-exported here so that
# callers import the whole engine boundary from one place.
from ikcode.engines.errors import (
    EmptyPrompt,
    EngineError,
    EngineOverloaded,
    EngineShutdown,
    InvalidSampling,
    PromptTooLong,
    TokenOutOfVocab,
)
from ikcode.engines.events import (
    CacheLookup,
    EngineInfo,
    EngineLoad,
    FinishReason,
    LifecycleEvent,
    LifecycleKind,
    LifecycleListener,
    RequestStats,
    TokenEvent,
)
from ikcode.engines.request import EngineRequest, PromptBlockHashes, SamplingParams, check_request
from ikcode.engines.stream import RequestStream
from ikcode.model.errors import ModelLoadError  # the model layer's; re-exported

__all__ = [
    "CacheLookup",
    "EmptyPrompt",
    "Engine",
    "EngineError",
    "EngineInfo",
    "EngineLoad",
    "EngineOverloaded",
    "EngineRequest",
    "EngineShutdown",
    "FinishReason",
    "InvalidSampling",
    "LifecycleEvent",
    "LifecycleKind",
    "LifecycleListener",
    "ModelLoadError",
    "PromptBlockHashes",
    "PromptTooLong",
    "RequestStats",
    "RequestStream",
    "SamplingParams",
    "TokenEvent",
    "TokenOutOfVocab",
    "check_request",
]


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
