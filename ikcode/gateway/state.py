"""Everything one gateway app holds, handed to the route handlers."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ikcode.engines.base import Engine
from ikcode.gateway.block_hashes import IncrementalBlockHasher
from ikcode.gateway.chat_format import TokenizerLike
from ikcode.gateway.metrics import GatewayMetrics
from ikcode.gateway.render import Renderer
from ikcode.gateway.request_log import RequestLog, now_iso
from ikcode.gateway.session_prefix import SessionPrefixes
from ikcode.gateway.settings import GatewaySettings


@dataclass
class Gateway:
    engine: Engine
    tokenizer: TokenizerLike
    renderer: Renderer
    settings: GatewaySettings
    metrics: GatewayMetrics
    log: RequestLog
    context_window: int
    in_flight: int = 0
    in_flight_by_user: Counter[str] = field(default_factory=Counter)  # token name -> running
    draining: bool = False  # shutting down: new requests are refused, running ones finish or are cut
    generations: dict[str, Any] = field(default_factory=dict)  # request id -> running Generation
    cutting: bool = False  # the drain deadline passed: every generation, running or starting, is cut
    body_limit_bytes: int = 0  # 0: settings.max_body_bytes (see request_limits)
    max_token_chars: int | None = None  # the character check's bound; None: no such check
    # the latest prompt of each session, to log how much of the next one repeats it
    sessions: SessionPrefixes = field(default_factory=SessionPrefixes)
    # Each conversation's block hashes, resumed turn after turn: the one hash of a prompt that the
    # lookup, the admission layer and the engine all reuse.
    block_hasher: IncrementalBlockHasher = field(init=False)
    # When this server started: its request log may hold records of earlier runs (doctor reads
    # only this run's).
    started_at: str = field(default_factory=now_iso)

    def __post_init__(self) -> None:
        self.block_hasher = IncrementalBlockHasher(self.engine.info.block_size)
