"""What one gateway instance serves and how it guards itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class GatewaySettings:
    served_model: str = "ikcode"
    # Other names accepted for the served model (the launcher maps every Claude Code role to
    # one of these). Anything else is a 404 that names the model: a leak must be visible.
    model_aliases: tuple[str, ...] = ()
    display_name: str | None = None
    context_window: int | None = None  # None: the engine's
    max_output_tokens: int = 32_000  # a larger max_tokens is a 400
    auth_tokens: dict[str, str] = field(default_factory=dict)  # name -> token; empty = no auth
    bind_loopback: bool = True  # False (e.g. 0.0.0.0) requires auth_tokens
    request_log_path: Path | None = None  # JSON lines, one per request
    ping_interval_s: float = 5.0  # `event: ping` after this long without another event
    log_prompts: bool = False  # put prompt/answer token ids and text in the request log
    max_body_bytes: int = 32 * 1024 * 1024
    max_concurrent_requests: int | None = None  # beyond it: 429 with retry-after
    # Requests one token may have running at once (beyond it: 429 with retry-after), so one user
    # cannot take a shared server's queue for himself. None: no such limit.
    max_requests_per_user: int | None = None
    default_temperature: float = 1.0  # the Messages API default
    # Server-side repetition penalties (the Messages API has no field for them); off by default.
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Output cap of Claude Code's compaction (summary) requests; None: only max_output_tokens.
    summary_max_tokens: int | None = None
    # Isolate each auth token's cache entries: one user's prompt must never be served (or timed)
    # from another's cache. None: on whenever more than one token can reach the server.
    cache_salt_per_user: bool | None = None
    # message_start carries the engine's cache prediction (engine.lookup hashes the whole prompt)
    # up to this prompt size; above it only the final message_delta usage has the cache figures.
    predict_usage_max_tokens: int = 32_768
    # How long the cache keeps an agent session's tail on the device after a step (needs the
    # "ikcode" cache policy; plain LRU ignores holds). None: no holds.
    session_hold_s: float | None = 60.0
    tool_format: str = ""  # a gateway/tool_formats name; "" = chosen from the model's chat template
    # Tokens of conversations the gateway remembers between turns (previous renders, session
    # prefixes; segment tokenizations get twice as many). A conversation it forgot is tokenized
    # whole on its next turn (~2 s of one core for 450K tokens). None: at least
    # what the engine's KV memory holds (conversation_store.memory_tokens_for).
    conversation_memory_tokens: int | None = None

    @property
    def salts_per_user(self) -> bool:
        if self.cache_salt_per_user is None:
            return len(self.auth_tokens) > 1
        return self.cache_salt_per_user

    def accepts(self, model: str) -> bool:
        return model == self.served_model or model in self.model_aliases

    def validate(self) -> None:
        if not self.bind_loopback and not self.auth_tokens:
            raise ValueError("refusing to serve on a non-loopback address without auth tokens")
        if any(not token for token in self.auth_tokens.values()):
            raise ValueError("auth tokens must not be empty")
        if self.conversation_memory_tokens is not None and self.conversation_memory_tokens <= 0:
            raise ValueError("conversation_memory_tokens must be > 0")
        if self.ping_interval_s <= 0:
            raise ValueError("ping_interval_s must be > 0")
