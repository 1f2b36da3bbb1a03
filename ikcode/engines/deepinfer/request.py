"""One request inside the DeepInfer adapter: what the engine thread knows about it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ikcode.cache import BlockHash
from ikcode.engines.base import EngineRequest, RequestStats, RequestStream


@dataclass(eq=False)
class RankRequest:
    request: EngineRequest
    stream: RequestStream
    hashes: list[BlockHash]  # keys of the prompt's full 128-token blocks
    stats: RequestStats = field(default_factory=RequestStats)
    seq: Any = None  # DeepInfer's Sequence once add_request returned it
    admitted: bool = False  # try_allocate_seq succeeded and the sequence was handed to the engine
    engine_tokens: list[int] = field(default_factory=list)  # prompt + every emitted id (EOS too)
    num_streamed: int = 0  # output tokens handed to the stream (EOS and stop ids stripped)
    closed: bool = False  # the stream got its final event
    engine_finished: bool = False  # the engine reported finished=True (it may still hold the KV)
    failed: bool = False  # its KV may be garbage: never committed
    # Sliding-window state taken at 128 boundaries while it ran (the engine keeps only the last
    # one), so a next turn that adds fewer than KEEP tokens can still resume close to its end.
    snapshots: dict[int, Any] = field(default_factory=dict)
    internal: bool = False  # a priming pass: no stream reader, no lifecycle events, no stats
    prime: RankRequest | None = None  # the priming pass this request waits for
    cached_before_prime: tuple[int, int] | None = None  # (device, host) tokens cached at lookup

    def __post_init__(self) -> None:
        self.engine_tokens = list(self.request.prompt_token_ids)
        self.stats.prompt_tokens = len(self.engine_tokens)

    @property
    def request_id(self) -> str:
        return self.request.request_id
