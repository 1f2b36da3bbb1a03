"""Everything one upstream front holds, handed to the route handlers."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from ikcode.auth import user_session
from ikcode.gateway.drain import check_draining
from ikcode.gateway.edge import check_concurrency
from ikcode.gateway.request_log import RequestLog, now_iso
from ikcode.gateway.settings import GatewaySettings

from .admission import UpstreamAdmission
from .config import UpstreamConfig
from .metrics import UpstreamMetrics
from .router import Router


@dataclass
class Upstream:
    config: UpstreamConfig
    settings: GatewaySettings  # served model, aliases, auth tokens, request log, ping interval
    router: Router
    metrics: UpstreamMetrics
    log: RequestLog
    context_window: int
    client: httpx.AsyncClient | None = None  # opened in the app's lifespan (one per event loop)
    in_flight: int = 0
    in_flight_by_user: Counter[str] = field(default_factory=Counter)  # token name -> in flight
    admission: UpstreamAdmission | None = None  # None: requests go straight to their replica
    started_at: str = field(default_factory=now_iso)
    salt_key: str = ""  # auth.salt_key(): keys each user's cache_salt (openai_proxy.cache_salt)
    draining: bool = False  # shutting down: new requests get 529 + retry (gateway.drain)
    cutting: bool = False  # the drain deadline passed (its relayed streams are left to uvicorn)

    def settle(self, record: dict) -> None:
        """A request is over (answered, failed or cut): admission frees its place."""
        if self.admission is not None:
            self.admission.done(
                record["request_id"],
                self.router.url_of(record.get("replica")),
                record.get("prompt_tokens") or 0,
                record.get("cached_tokens"),
            )

    def stream_started(self, user: str | None) -> None:
        """One request is in flight from now until stream_ended; 429 first when the server, or
        this token, has as many as it may (the gateway's limits, the same settings); 529 while
        the front drains."""
        check_draining(self)
        check_concurrency(self.settings, self.in_flight, self.in_flight_by_user, user)
        self.in_flight += 1
        self.in_flight_by_user[user or ""] += 1
        self.metrics.in_flight.inc()

    def stream_ended(self, user: str | None) -> None:
        """One request stopped being in flight (its answer was sent, or its stream ended)."""
        self.in_flight = max(0, self.in_flight - 1)
        self.in_flight_by_user[user or ""] -= 1
        if self.in_flight_by_user[user or ""] <= 0:
            del self.in_flight_by_user[user or ""]
        self.metrics.in_flight.dec()

    def session_key(self, user: str | None, request: Any) -> str | None:
        """The key routing and admission remember a request's session by: Claude Code's session
        header within the user's own namespace, as the gateway keeps it, whether or not their
        caches are shared (one user who learns another's session id must not move that session
        or reset its admission memory)."""
        return user_session(user, request.headers.get("x-claude-code-session-id"))

    def first_token(self, record: dict) -> None:
        if self.admission is not None:
            self.admission.first_token(record["request_id"])

    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            self.client = new_client(self.config)
        return self.client


def new_client(config: UpstreamConfig) -> httpx.AsyncClient:
    timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=30)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
