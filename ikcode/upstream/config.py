"""UpstreamConfig: which existing server(s) ikcode fronts, read from a profile's [upstream] table.

[upstream]
kind = "openai"                       # "anthropic": forward /v1/messages as is; "openai": translate
urls = ["http://127.0.0.1:8000/v1"]   # one per replica; openai urls end in /v1
token_env = "IKCODE_UPSTREAM_TOKEN"   # env var holding the upstream's key ("" = none)
model = ""                            # the name the upstream serves ("" = served_model)
max_in_flight = 32                    # load guard: a replica at this many requests is overloaded
health_interval_s = 5.0
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal

KINDS = ("anthropic", "openai")


@dataclass
class UpstreamConfig:
    kind: Literal["anthropic", "openai"]
    urls: list[str]
    model: str = ""  # "" = forward the client's model name (anthropic) / the served model (openai)
    token: str | None = None  # resolved from token_env
    token_env: str = ""
    max_in_flight: int = 32  # a session moves off its replica only when the replica has this many
    health_interval_s: float = 5.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    # Retries on another replica of a request whose connection was closed before an answer (it may
    # have reached the replica: a retry may repeat its work); refused connections are always
    # retried on the replicas left. Then 503.
    retries: int = 1
    headers: dict[str, str] = field(default_factory=dict)  # extra headers for every upstream call

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"upstream.kind: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.urls or not all(
            isinstance(u, str) and u.startswith(("http://", "https://")) for u in self.urls
        ):
            raise ValueError(f"upstream.urls: expected a list of http(s) URLs, got {self.urls!r}")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError("upstream.urls: a URL is listed twice")
        self.urls = [u.rstrip("/") for u in self.urls]
        if self.max_in_flight < 1:
            raise ValueError("upstream.max_in_flight: must be >= 1")
        if self.health_interval_s <= 0:
            raise ValueError("upstream.health_interval_s: must be > 0")

    @classmethod
    def from_dict(cls, data: dict[str, Any], environ: dict[str, str] | None = None) -> UpstreamConfig:
        known = {f.name for f in fields(cls)} - {"token"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"upstream: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        if "kind" not in data or "urls" not in data:
            raise ValueError("upstream: `kind` and `urls` are required")
        values = dict(data)
        env = os.environ if environ is None else environ
        token_env = str(values.get("token_env") or "")
        values["token"] = env.get(token_env) or None if token_env else None
        return cls(**values)
