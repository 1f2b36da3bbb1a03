"""The upstream front: the Anthropic Messages API over existing servers (one or more replicas).

`create_upstream_app(config, settings)` builds it without a socket; serve it with
`ikcode.gateway.server.run_server` or `BackgroundServer`. It shares the gateway's wire models,
error shapes, SSE writer, auth, edge middleware and request log; what differs is behind the
route: a replica chosen per session, then forwarding (kind "anthropic") or translation to chat
completions (kind "openai").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ikcode.admission import AdmissionConfig
from ikcode.auth import salt_key
from ikcode.engines.base import EngineOverloaded
from ikcode.gateway.edge import (
    EdgeMiddleware,
    add_model_routes,
    authenticate,
    check_max_tokens,
    check_model,
    clip,
    clip_session,
    error_response,
    read_body,
    read_model,
    unless_client_leaves,
)
from ikcode.gateway.errors import APIError, error_body, invalid_request
from ikcode.gateway.messages import new_message_id
from ikcode.gateway.request_log import RequestLog, now_iso
from ikcode.gateway.schemas import CountTokensRequest, MessagesRequest
from ikcode.gateway.settings import GatewaySettings
from ikcode.gateway.sse import ClosingStreamingResponse

from . import anthropic_proxy, openai_proxy
from .admission import UpstreamAdmission
from .config import UpstreamConfig
from .forward import prefix_key
from .health import health_loop
from .metrics import UpstreamMetrics
from .router import NoReplica, Router
from .state import Upstream

logger = logging.getLogger("ikcode.upstream")
RETRY_AFTER_NO_REPLICA_S = 2


async def _read_raw(up: Upstream, request: Request) -> bytes:
    limit = up.settings.max_body_bytes
    too_large = lambda: APIError(413, f"request body is larger than {limit} bytes")  # noqa: E731
    return await read_body(request, limit, too_large)


async def _admit(up: Upstream, request: Request, body: dict[str, Any], record: dict[str, Any]) -> None:
    """Wait for this request's turn on the replica it will most likely go to (or shed it: 529)."""
    if up.admission is None or not isinstance(body.get("messages"), list):
        return
    session = up.session_key(record.get("user"), request)
    replica = up.router.peek(session, prefix_key(body))
    if replica is None:
        return  # no healthy replica: the forward answers 503
    length = request.headers.get("content-length", "")
    messages = body["messages"]
    queued = time.monotonic()
    try:
        # A client that hangs up while queued gives its place back now (enter's cancellation).
        ticket = await unless_client_leaves(
            request,
            up.admission.enter(
                record["request_id"], replica.url, session, messages, int(length) if length.isdigit() else 0
            ),
        )
    except EngineOverloaded as error:
        record["admission_class"] = "cold"
        raise APIError(529, str(error), retry_after_s=error.retry_after_s) from None
    record["admission_class"] = ticket.cls.value
    record["admission_wait_ms"] = round((time.monotonic() - queued) * 1000, 2)


def create_upstream_app(
    config: UpstreamConfig, settings: GatewaySettings, admission: AdmissionConfig | None = None
) -> FastAPI:
    """`admission`: ikcode's admission policy in front of the replicas (None = the default
    config; AdmissionConfig(policy="fifo") passes requests straight through)."""
    settings.validate()
    if not settings.context_window:
        raise ValueError("the upstream front needs settings.context_window (the profile's)")
    if config.kind == "anthropic" and settings.salts_per_user:
        # The Messages API has no cache salt: every user's prompts would share the upstream's cache
        # (and its cache_read_input_tokens would tell one user what another sent). Sharing is the
        # operator's explicit choice, never a default.
        raise ValueError(
            "an Anthropic-compatible upstream cannot keep users' caches apart (the Messages API has "
            "no cache salt): set salt_per_user = false under [cache] to share the upstream's cache "
            "among this front's users, or give each user a front of their own"
        )
    router = Router(config.urls, config.max_in_flight)
    up = Upstream(
        config,
        settings,
        router,
        UpstreamMetrics(router.snapshot),
        RequestLog(settings.request_log_path),
        settings.context_window,
    )
    if config.kind == "openai" and settings.salts_per_user:
        up.salt_key = salt_key()
    admission = admission or AdmissionConfig()
    if admission.policy != "fifo":
        up.admission = UpstreamAdmission(admission, config.urls)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        checks = asyncio.create_task(health_loop(up))
        try:
            yield
        finally:
            checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checks
            if up.client is not None:
                await up.client.aclose()
                up.client = None
            up.log.close()

    app = FastAPI(title="ikcode upstream", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.upstream = up
    app.add_middleware(EdgeMiddleware, gw=up)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            return error_response(APIError(404, f"not found: {request.method} {request.url.path}"))
        return error_response(APIError(error.status_code, str(error.detail)))

    async def guarded(request: Request, handler: Any) -> Response:
        try:
            return await handler()
        except APIError as error:
            return error_response(error)
        except NoReplica as error:
            retry = RETRY_AFTER_NO_REPLICA_S
            return error_response(APIError(503, f"{error}; retry shortly", retry_after_s=retry))
        except Exception:
            logger.exception("unexpected error on %s", request.url.path)
            return JSONResponse(error_body("api_error", "internal server error"), status_code=500)

    @app.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        arrived = time.monotonic()
        record: dict[str, Any] = {
            "ts": now_iso(),
            "request_id": new_message_id(),
            "session_id": clip_session(request.headers.get("x-claude-code-session-id")),
            "upstream_kind": config.kind,
        }

        async def handler() -> Response:
            record["user"] = authenticate(up, request)
            up.stream_started(record["user"])
            answer: Response | None = None
            try:
                if config.kind == "anthropic":
                    raw = await _read_raw(up, request)
                    parsed = _parse_body(raw)
                    # The body goes on as it is, but what its reply may cost is the front's to
                    # bound: only a whole number it can check passes (an upstream may coerce
                    # "100000", or read another value than this one).
                    max_tokens = parsed.get("max_tokens")
                    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
                        got = clip(repr(max_tokens))
                        raise invalid_request(f"max_tokens: a whole number is required, got {got}")
                    check_max_tokens(up, max_tokens)
                    await _admit(up, request, parsed, record)
                    answer = await anthropic_proxy.forward_messages(up, request, raw, record, arrived, parsed)
                else:
                    body = await read_model(up, request, MessagesRequest)
                    check_model(up, body.model)
                    check_max_tokens(up, body.max_tokens)
                    record.update(model=body.model, stream=bool(body.stream))
                    data = body.model_dump(exclude_none=True)
                    await _admit(up, request, data, record)
                    answer = await openai_proxy.forward_messages(up, request, body, record, arrived, data)
                return answer
            except BaseException:
                up.settle(record)  # refused or failed before an answer: free its admission place
                raise
            finally:
                # A relayed stream stays in flight until its StreamEnd runs (forward.py).
                if not isinstance(answer, ClosingStreamingResponse):
                    up.stream_ended(record["user"])

        response = await guarded(request, handler)
        if "status" not in record:  # refused before reaching a replica
            record.update(
                status=response.status_code, error=bytes(response.body)[:300].decode("utf-8", "replace")
            )
            up.log.write(record)
        return response

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        async def handler() -> Response:
            user = authenticate(up, request)
            # Upstream work (kind openai: a prefill and one token), under the same per-user cap.
            up.stream_started(user)
            try:
                if config.kind == "anthropic":
                    raw = await _read_raw(up, request)
                    parsed = _parse_body(raw)
                    return await anthropic_proxy.forward_count_tokens(up, request, raw, user, parsed)
                body = await read_model(up, request, CountTokensRequest)
                check_model(up, body.model)
                return await openai_proxy.count_tokens(up, request, body, user)
            finally:
                up.stream_ended(user)

        return await guarded(request, handler)

    add_model_routes(app, up, guarded)

    @app.get("/health")
    async def health(request: Request) -> Response:
        replicas = router.snapshot()
        status = "ok" if any(r["healthy"] for r in replicas) else "no_healthy_replica"
        # As the gateway's: anyone may ask whether it is up; only a token holder sees the rest.
        try:
            authenticate(up, request)
        except APIError:
            return JSONResponse({"status": status})
        return JSONResponse(
            {
                "status": status,
                "model": settings.served_model,
                "engine": "upstream",
                "upstream_kind": config.kind,
                "device": "upstream",
                "context_window": up.context_window,
                "in_flight": up.in_flight,
                "started_at": up.started_at,
                "replicas": replicas,
                "session_moves": dict(router.moves),
                "admission": up.admission.stats() if up.admission else {"policy": "fifo"},
                **up.metrics.totals(),
            }
        )

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        async def handler() -> Response:
            authenticate(up, request)
            return Response(generate_latest(up.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        return await guarded(request, handler)

    return app


class _RepeatedKey(ValueError):
    pass


def _parse_body(raw: bytes) -> dict[str, Any]:
    """The body as the front reads it, or a 400 of its own: what it cannot read it cannot bound,
    so it is not forwarded (a number past json's 4,300 digits once carried max_tokens 100,000,000
    past the check and admission; a deep nesting was a 500 with a traceback)."""
    try:
        parsed = json.loads(raw, object_pairs_hook=_refuse_repeated_keys)
    except _RepeatedKey as err:
        raise invalid_request(f"request body: key {clip(str(err))} appears twice") from None
    except (ValueError, RecursionError):
        raise invalid_request("request body is not valid JSON or is nested too deeply") from None
    if not isinstance(parsed, dict):
        raise invalid_request("request body must be a JSON object")
    return parsed


def _refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads keeps a repeated key's last value, another parser may keep its first: a body
    the front checks must mean one thing to both."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen.add(key)
    return dict(pairs)
