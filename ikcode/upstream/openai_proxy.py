"""kind = "openai": Anthropic Messages in, chat completions upstream, Anthropic Messages out."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ikcode.gateway.errors import APIError, error_body
from ikcode.gateway.messages import new_message_id
from ikcode.gateway.schemas import CountTokensRequest, MessagesRequest
from ikcode.gateway.sse import PING, STREAM_HEADERS, ClosingStreamingResponse, sse_event

from .forward import (
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
from .openai_request import to_chat_request
from .openai_response import UpstreamUsage, to_anthropic_error, to_message
from .openai_stream import StreamTranslator
from .pings import with_pings
from .state import Upstream

logger = logging.getLogger("ikcode.upstream")

CHAT_PATH = "/chat/completions"


def cache_salt(user: str | None, key: str) -> str:
    """The user's cache namespace upstream, as `cache_salt`: vLLM keys its prefix cache by it
    ("to prevent an attacker to guess prompts in multi-user environments", its chat request's
    field, which it asks to be random and kept from third parties), and servers that do not know
    the field ignore it. Keyed by this server's secret (auth.salt_key): no user name travels,
    and no one who can reach the upstream can name another user's namespace."""
    return hmac.new(key.encode(), f"ikcode-user:{user or ''}".encode(), hashlib.blake2b).hexdigest()[:32]


async def _send(
    up: Upstream, request: Request, data: dict[str, Any], record: dict[str, Any] | None, user: str | None
):
    chat = to_chat_request(data, up.config.model or up.settings.served_model)
    if up.settings.salts_per_user:
        chat["cache_salt"] = cache_salt(user, up.salt_key)
    content = json.dumps(chat, ensure_ascii=False, separators=(",", ":")).encode()
    headers = upstream_headers(up, request.headers, anthropic=False)
    session = up.session_key(user, request)
    replica, response, attempts = await open_stream(
        up, request, CHAT_PATH, content, headers, session, prefix_key(data)
    )
    if record is not None:
        record.update(replica=replica.name, attempts=attempts, status=response.status_code)
    return replica, response


def _error_response(response: httpx.Response, raw: bytes) -> JSONResponse:
    status, body = to_anthropic_error(response.status_code, raw)
    return JSONResponse(
        body, status_code=status, headers=response_headers(response) | {"content-type": "application/json"}
    )


async def forward_messages(
    up: Upstream,
    request: Request,
    body: MessagesRequest,
    record: dict[str, Any],
    arrived: float,
    data: dict[str, Any] | None = None,
) -> Response:
    data = body.model_dump(exclude_none=True) if data is None else data
    replica, response = await _send(up, request, data, record, record.get("user"))
    message_id = new_message_id()
    stops = body.stop_sequences or []
    if response.status_code != 200 or not body.stream:
        try:
            raw = await read_answer(up, request, replica, response)
        except APIError as error:  # the client left, or the replica went silent
            record["status"] = error.status
            _finish(up, record, UpstreamUsage(), None, None, arrived, error.message)
            raise
    if response.status_code != 200:
        reply = _error_response(response, raw)
        record["status"] = reply.status_code
        why = logged_error(up.settings.log_prompts, response.status_code, raw)
        _finish(up, record, UpstreamUsage(), None, None, arrived, why)
        return reply
    if not body.stream:
        try:
            message, usage = to_message(json.loads(raw), message_id, body.model, stops)
        except Exception as err:  # not a chat completion (a proxy's HTML page, a cut body)
            record["status"] = 500
            why = f"upstream answer could not be read as a chat completion ({type(err).__name__})"
            _finish(up, record, UpstreamUsage(), None, None, arrived, why)
            raise APIError(500, why) from None
        _finish(up, record, usage, time.monotonic(), message["stop_reason"], arrived, None)
        return JSONResponse(message)
    translator = StreamTranslator(message_id, body.model, stops)
    end = StreamEnd(up, replica, response, record.get("user"))

    def hung_up() -> None:
        record["usage_source"] = translator.usage_source
        _finish(up, record, translator.usage, None, None, arrived, "client disconnected")

    return ClosingStreamingResponse(
        _translate(up, translator, record, arrived, end),
        on_close=lambda: end(hung_up),
        outcome=lambda: stream_outcome(record),
        media_type="text/event-stream",
        headers=STREAM_HEADERS,
    )


async def _translate(
    up: Upstream, tr: StreamTranslator, record: dict, arrived: float, end: StreamEnd
) -> AsyncIterator[bytes]:
    replica, response = end.replica, end.response
    first_at: float | None = None
    error: str | None = None
    error_type = "api_error"
    done = False
    try:
        yield tr.start()
        async for line in with_pings(response.aiter_lines(), up.settings.ping_interval_s):
            if line is None:
                yield PING
                continue
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            if not isinstance(chunk, dict):
                raise json.JSONDecodeError("not a JSON object", payload, 0)
            if chunk.get("error"):
                error = logged_error(up.settings.log_prompts, None, chunk)
                break
            for event in tr.feed(chunk):
                yield event
            if first_at is None and tr.first_token:
                first_at = time.monotonic()
                up.first_token(record)
        if error is None and tr.finish_reason is None:
            # [DONE] (or the end) without a finish reason: the server cut the answer short
            # (llama-cpp-python does so when another request arrives): retryable, not end_turn.
            error = "upstream stream ended without a finish reason" + (" ([DONE] sent)" if done else "")
            error_type = "overloaded_error"
        if error is None and tr.lost_fragments:
            error = "upstream streamed tool calls interleaved: a call's arguments came after its block ended"
        if error is None:
            for event in tr.finish():
                yield event
        else:
            suffix = "; retry" if error_type == "overloaded_error" else ""
            yield sse_event(error_body(error_type, f"upstream: {error}{suffix}"))
    except httpx.HTTPError as err:  # the replica died mid-stream: say so in-band; the client retries
        up.router.mark_down(replica, f"stream cut: {type(err).__name__}")
        error = f"upstream stream cut: {type(err).__name__}"
        yield sse_event(error_body("overloaded_error", "upstream replica failed mid-stream; retry"))
    except json.JSONDecodeError:
        error = "upstream sent a chunk that is not a JSON object"
        yield sse_event(error_body("api_error", error))
    except (asyncio.CancelledError, GeneratorExit):  # the client left: logged as such, not as answered
        error = error or "client disconnected"
        raise
    except Exception as err:  # a chunk this translation cannot read: end the stream with an error
        logger.exception("translating the upstream stream failed")
        error = f"upstream stream could not be translated: {type(err).__name__}"
        yield sse_event(error_body("api_error", error))
    finally:

        def finish() -> None:
            record["usage_source"] = tr.usage_source
            _finish(up, record, tr.usage, first_at, None if error else tr.stop_reason_now(), arrived, error)

        await end(finish)


def _finish(
    up: Upstream,
    record: dict[str, Any],
    usage: UpstreamUsage,
    first_at: float | None,
    stop_reason: str | None,
    arrived: float,
    error: str | None,
) -> None:
    finish_record(record, usage.prompt_tokens, usage.cached_tokens, usage.output_tokens)
    record.setdefault("usage_source", "reported_by_upstream")
    record.update(
        ttft_ms=None if first_at is None else round((first_at - arrived) * 1000, 2),
        duration_ms=round((time.monotonic() - arrived) * 1000, 2),
        stop_reason=stop_reason,
        error=error,
    )
    up.settle(record)
    up.metrics.observe(record)
    up.log.write(record)


async def count_tokens(
    up: Upstream, request: Request, body: CountTokensRequest, user: str | None
) -> Response:
    """Chat completions have no token count: ask for one token and read `prompt_tokens`."""
    data = body.model_dump(exclude_none=True)
    data.update(max_tokens=1, stream=False)
    replica, response = await _send(up, request, data, None, user)
    raw = await read_answer(up, request, replica, response)
    if response.status_code != 200:
        return _error_response(response, raw)
    return JSONResponse(
        {"input_tokens": UpstreamUsage.from_openai(json.loads(raw).get("usage")).prompt_tokens}
    )
