"""kind = "anthropic": forward /v1/messages and count_tokens as they are.

The body goes upstream byte for byte (unknown fields and beta headers included; only `model` is
rewritten when the profile names the upstream's own model), and the answer comes back the same
way: error bodies unmodified, a stream relayed chunk by chunk as it arrives. ikcode only reads
along: the first content delta (TTFT, measured here) and the usage events (cache, as reported).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ikcode.gateway.edge import clip
from ikcode.gateway.errors import APIError, error_body
from ikcode.gateway.sse import STREAM_HEADERS, ClosingStreamingResponse, sse_event

from .forward import (
    SSEScanner,
    StreamEnd,
    logged_error,
    open_stream,
    prefix_key,
    read_answer,
    response_headers,
    stream_outcome,
    upstream_headers,
)
from .metrics import finish_record
from .state import Upstream


def _usage_numbers(usage: dict[str, Any]) -> tuple[int, int | None, int]:
    read = usage.get("cache_read_input_tokens")
    created = usage.get("cache_creation_input_tokens") or 0
    prompt = (usage.get("input_tokens") or 0) + (read or 0) + created
    return prompt, read, usage.get("output_tokens") or 0


class _Tap:
    """What ikcode learns from an Anthropic answer while relaying it."""

    def __init__(self, log_prompts: bool = False) -> None:
        self.log_prompts = log_prompts  # whether an error's message may go to the request log
        self.usage: dict[str, Any] = {}
        self.first_delta_at: float | None = None
        self.stop_reason: str | None = None
        self.error: str | None = None
        self.stopped = False  # message_stop seen: the answer is whole

    def see(self, event: str, data: bytes, now: float) -> None:
        if event == "content_block_delta":
            if self.first_delta_at is None:
                self.first_delta_at = now
            return
        if event == "message_stop":
            self.stopped = True
            return
        if event not in ("message_start", "message_delta", "error"):
            return
        try:
            payload = json.loads(data)
        except ValueError:
            return
        if event == "message_start":
            self.usage.update((payload.get("message") or {}).get("usage") or {})
        elif event == "message_delta":
            # A full set in message_delta wins over message_start (as Claude Code reads it).
            self.usage.update({k: v for k, v in (payload.get("usage") or {}).items() if v is not None})
            self.stop_reason = (payload.get("delta") or {}).get("stop_reason")
        else:
            self.error = logged_error(self.log_prompts, None, payload)


def _body_for_upstream(up: Upstream, raw: bytes, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """The bytes to send (the client's own, unless the model is renamed) and the body parsed (the
    front parsed it first: what it cannot read is refused, app._parse_body)."""
    if up.config.model and body.get("model") != up.config.model:
        body["model"] = up.config.model
        raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    return raw, body


async def forward_messages(
    up: Upstream, request: Request, raw: bytes, record: dict[str, Any], arrived: float, parsed: dict[str, Any]
) -> Response:
    content, body = _body_for_upstream(up, raw, parsed)
    model = body.get("model")  # the client's, as it came (no model check here): clipped, a string
    record.update(model=clip(model) if isinstance(model, str) else None, stream=bool(body.get("stream")))
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    session = up.session_key(record.get("user"), request)
    headers = upstream_headers(up, request.headers, anthropic=True, session_key=session)
    replica, response, attempts = await open_stream(
        up, request, path, content, headers, session, prefix_key(body)
    )
    record.update(replica=replica.name, attempts=attempts, status=response.status_code)
    tap = _Tap(up.settings.log_prompts)
    if response.status_code != 200 or not body.get("stream"):
        try:
            data = await read_answer(up, request, replica, response)
        except APIError as error:  # the client left, or the replica went silent
            record["status"] = error.status
            tap.error = error.message
            _finish(up, record, tap, arrived)
            raise
        if response.status_code == 200:
            try:
                answer = json.loads(data)
                tap.usage = answer.get("usage") or {}
                tap.stop_reason = answer.get("stop_reason")
                tap.first_delta_at = time.monotonic()
            except (ValueError, AttributeError):
                pass
        else:
            tap.error = logged_error(up.settings.log_prompts, response.status_code, data)
        _finish(up, record, tap, arrived)
        return Response(data, status_code=response.status_code, headers=response_headers(response))
    end = StreamEnd(up, replica, response, record.get("user"))

    def hung_up() -> None:
        tap.error = tap.error or "client disconnected"
        _finish(up, record, tap, arrived)

    return ClosingStreamingResponse(
        _relay(tap, record, arrived, end),
        on_close=lambda: end(hung_up),
        outcome=lambda: stream_outcome(record),
        status_code=200,
        media_type="text/event-stream",
        headers={**response_headers(response), **STREAM_HEADERS},
    )


async def _relay(tap: _Tap, record: dict, arrived: float, end: StreamEnd) -> AsyncIterator[bytes]:
    up, replica, response = end.up, end.replica, end.response
    scanner = SSEScanner()
    pending = b""  # bytes of an event not complete yet: relayed whole or not at all
    try:
        async for chunk in response.aiter_raw():
            now = time.monotonic()
            had_first = tap.first_delta_at is not None
            for event, data in scanner.feed(chunk):
                tap.see(event, data, now)
            if not had_first and tap.first_delta_at is not None:
                up.first_token(record)
            pending += chunk
            whole = complete_events_end(pending)
            if whole:
                yield pending[:whole]
                pending = pending[whole:]
        if pending:
            yield pending  # the server's own last bytes, as it framed them
        if not tap.stopped and tap.error is None:
            # A clean end of the connection before message_stop (a proxy or server that closed
            # early): without an error event the client would take the cut answer as whole.
            tap.error = "upstream stream ended before message_stop"
            yield sse_event(error_body("overloaded_error", "upstream answer was cut short; retry"))
    except (asyncio.CancelledError, GeneratorExit):  # the client left: logged as such, not as answered
        tap.error = tap.error or "client disconnected"
        raise
    except Exception as err:  # the replica died mid-stream: say so in-band; the client retries
        up.router.mark_down(replica, f"stream cut: {type(err).__name__}")
        tap.error = f"upstream stream cut: {type(err).__name__}"
        yield sse_event(error_body("overloaded_error", "upstream replica failed mid-stream; retry"))
    finally:
        await end(lambda: _finish(up, record, tap, arrived))


def complete_events_end(buffer: bytes) -> int:
    """Where the last complete SSE event in buffer ends (0: none yet). A replica that dies in
    the middle of an event must not leave half of it before the error event that follows."""
    lf, crlf = buffer.rfind(b"\n\n"), buffer.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _finish(up: Upstream, record: dict[str, Any], tap: _Tap, arrived: float) -> None:
    prompt, cached, output = _usage_numbers(tap.usage)
    finish_record(record, prompt, cached, output)
    ttft = None if tap.first_delta_at is None else tap.first_delta_at - arrived
    record.update(
        ttft_ms=None if ttft is None else round(ttft * 1000, 2),
        duration_ms=round((time.monotonic() - arrived) * 1000, 2),
        stop_reason=tap.stop_reason,
        error=tap.error,
    )
    up.settle(record)
    up.metrics.observe(record)
    up.log.write(record)


async def forward_count_tokens(
    up: Upstream, request: Request, raw: bytes, user: str | None, parsed: dict[str, Any]
) -> Response:
    content, body = _body_for_upstream(up, raw, parsed)
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    session = up.session_key(user, request)
    headers = upstream_headers(up, request.headers, anthropic=True, session_key=session)
    replica, response, _ = await open_stream(up, request, path, content, headers, session, prefix_key(body))
    data = await read_answer(up, request, replica, response)
    return Response(data, status_code=response.status_code, headers=response_headers(response))
