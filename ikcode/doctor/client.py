"""The endpoint as Claude Code sees it, over plain HTTP (httpx): auth headers, SSE parsing, TTFT."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ikcode import auth

ANTHROPIC_VERSION = "2023-06-01"
SESSION_HEADER = "X-Claude-Code-Session-Id"


@dataclass
class StreamResult:
    status: int
    events: list[dict[str, Any]] = field(default_factory=list)  # decoded `data:` payloads, in order
    text: str = ""
    # Every delta's payload in order (text, thinking, tool-call JSON): what two answers are
    # compared by (a reasoning model can spend a short answer on thinking: its text is empty).
    answer: str = ""
    ttft_s: float | None = None  # request sent -> first content_block_delta
    total_s: float = 0.0
    error: dict[str, Any] | None = None  # the error body (HTTP error or an `error` event)

    @property
    def kinds(self) -> list[str]:
        return [event.get("type", "") for event in self.events]

    @property
    def usage(self) -> dict[str, Any]:
        """Usage as a client reads it: message_start's, overridden by message_delta's fields."""
        usage: dict[str, Any] = {}
        for event in self.events:
            if event.get("type") == "message_start":
                usage.update((event.get("message") or {}).get("usage") or {})
            elif event.get("type") == "message_delta":
                usage.update(event.get("usage") or {})
        return usage


def hit_rate(usage: dict[str, Any]) -> float | None:
    """cache_read / (input + cache_read + cache_creation), as Claude Code accounts for it."""
    try:
        read = int(usage.get("cache_read_input_tokens") or 0)
        total = int(usage["input_tokens"]) + read + int(usage.get("cache_creation_input_tokens") or 0)
    except (KeyError, TypeError, ValueError):
        return None
    return read / total if total else None


class EndpointClient:
    def __init__(
        self, base_url: str, token: str | None, connect_timeout_s: float = 3.0, read_timeout_s: float = 300.0
    ):
        self.base_url = base_url.rstrip("/")
        headers = {"anthropic-version": ANTHROPIC_VERSION, "User-Agent": "ikcode-doctor"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        self.http = httpx.Client(headers=headers, timeout=timeout, trust_env=auth.proxied(base_url))
        # A whole streamed answer's bound: the server's pings reset httpx's read timeout, so a
        # wedged engine behind a live gateway would otherwise keep doctor waiting for ever.
        self.answer_timeout_s = read_timeout_s

    def close(self) -> None:
        self.http.close()

    def url(self, path: str) -> str:
        return self.base_url + path

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.http.get(self.url(path), **kwargs)

    def post(self, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        return self.http.post(self.url(path), json=body, **kwargs)

    def stream_message(self, body: dict[str, Any], session_id: str | None = None) -> StreamResult:
        """POST /v1/messages with stream=true; the SSE events decoded, the text joined, TTFT timed."""
        headers = {SESSION_HEADER: session_id} if session_id else {}
        started = time.monotonic()
        with self.http.stream(
            "POST", self.url("/v1/messages"), json={**body, "stream": True}, headers=headers
        ) as r:
            result = StreamResult(r.status_code)
            if r.status_code != 200:
                r.read()
                result.error = _json_or_text(r)
                result.total_s = time.monotonic() - started
                return result
            for line in r.iter_lines():
                if time.monotonic() - started > self.answer_timeout_s:
                    message = f"no whole answer within {self.answer_timeout_s:.0f} s, the stream still open"
                    result.error = {"type": "error", "error": {"type": "timeout", "message": message}}
                    break
                if not line.startswith("data:"):
                    continue
                try:
                    event = json.loads(line[5:].strip())
                except ValueError:
                    continue
                result.events.append(event)
                kind = event.get("type")
                if kind == "content_block_delta":
                    if result.ttft_s is None:
                        result.ttft_s = time.monotonic() - started
                    delta = event.get("delta") or {}
                    result.text += delta.get("text", "")
                    result.answer += "".join(
                        str(delta.get(key, "")) for key in ("text", "thinking", "partial_json")
                    )
                elif kind == "error":
                    result.error = event
        result.total_s = time.monotonic() - started
        return result


def _json_or_text(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
        return data if isinstance(data, dict) else {"body": data}
    except ValueError:
        return {"body": response.text[:300]}


def error_message(body: dict[str, Any] | None) -> str:
    if not body:
        return ""
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message", ""))
    return str(body.get("body", ""))[:200]
