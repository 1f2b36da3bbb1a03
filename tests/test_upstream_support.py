"""Shared setup of the upstream tests: real ikcode servers (tiny embedded engine) as upstream
replicas, and ikcode's upstream front over them, all on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ikcode.gateway import BackgroundServer, GatewaySettings, create_app
from ikcode.upstream import UpstreamConfig, create_upstream_app
from tests.test_gateway_support import tiny_tokenizer
from tests.tiny_model import tiny_engine

torch.set_num_threads(1)

UPSTREAM_TOKEN = "upstream-secret"
FRONT_TOKEN = "front-token"


class EmbeddedReplica:
    """An ikcode gateway over its own tiny embedded engine: a real Anthropic-compatible server."""

    def __init__(self, tmp_path: Path, name: str = "replica", kv_mb: int = 4, **settings):
        self.engine = tiny_engine(kv_memory_bytes=kv_mb * 1024 * 1024)
        self.engine.start()
        self.log_path = tmp_path / f"{name}-requests.jsonl"
        values = dict(
            served_model="tiny",
            max_output_tokens=256,
            auth_tokens={"front": UPSTREAM_TOKEN},
            request_log_path=self.log_path,
            default_temperature=0.0,
            ping_interval_s=0.2,
        )
        values.update(settings)
        self.server = BackgroundServer(
            create_app(self.engine, tiny_tokenizer(), GatewaySettings(**values))
        ).start()
        self.url = self.server.url
        self.stopped = False

    def records(self) -> list[dict]:
        if not self.log_path.exists():
            return []
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line]

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.server.stop()
            self.engine.shutdown(drain_timeout_s=1)


def front_server(tmp_path: Path, kind: str, urls: list[str], token: str | None = UPSTREAM_TOKEN, **config):
    return BackgroundServer(front_app(tmp_path, kind, urls, token, **config)).start()


def front_app(tmp_path: Path, kind: str, urls: list[str], token: str | None = UPSTREAM_TOKEN, **config):
    values = dict(
        served_model=config.pop("served_model", "tiny"),
        context_window=config.pop("context_window", 2048),
        max_output_tokens=256,
        auth_tokens={"alice": FRONT_TOKEN},
        request_log_path=tmp_path / "front-requests.jsonl",
        ping_interval_s=0.2,
    )
    settings = GatewaySettings(**(values | config.pop("settings", {})))
    upstream = UpstreamConfig(kind=kind, urls=urls, token=token, **config)
    return create_upstream_app(upstream, settings)


def front_records(tmp_path: Path) -> list[dict]:
    path = tmp_path / "front-requests.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
