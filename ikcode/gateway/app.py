"""The FastAPI app: Anthropic Messages API over any Engine.

`create_app(engine, tokenizer, settings)` builds it without a socket (tests use it in-process);
`ikcode.gateway.server.run_server` serves it with uvicorn. Every error leaves in Anthropic's
shape; unknown request fields and beta flags are accepted; a base-URL path prefix is stripped.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ikcode.auth import OWNER
from ikcode.engines.base import Engine
from ikcode.engines.placement import engine_kv_tokens
from ikcode.gateway import messages
from ikcode.gateway.chat_format import TokenizerLike
from ikcode.gateway.conversation_store import ConversationStore, memory_tokens_for
from ikcode.gateway.edge import EdgeMiddleware, add_model_routes, authenticate, error_response, read_model
from ikcode.gateway.errors import APIError, error_body, invalid_request
from ikcode.gateway.metrics import PER_USER, GatewayMetrics
from ikcode.gateway.render import Renderer
from ikcode.gateway.request_limits import body_limit_bytes, max_token_chars
from ikcode.gateway.request_log import RequestLog
from ikcode.gateway.schemas import CountTokensRequest, MessagesRequest
from ikcode.gateway.session_prefix import SessionPrefixes
from ikcode.gateway.settings import GatewaySettings
from ikcode.gateway.state import Gateway
from ikcode.gateway.tool_formats import tool_format_for

logger = logging.getLogger("ikcode.gateway")


def create_app(
    engine: Engine,
    tokenizer: TokenizerLike,
    settings: GatewaySettings,
    renderer: Renderer | None = None,
) -> FastAPI:
    settings.validate()
    memory_tokens = memory_tokens_for(settings.conversation_memory_tokens, engine_kv_tokens(engine))
    if renderer is None:
        template = getattr(tokenizer, "chat_template", None)
        renderer = Renderer(
            tokenizer,
            store=ConversationStore.sized(memory_tokens),
            tool_format=tool_format_for(template, settings.tool_format),
        )
    context_window = settings.context_window or engine.info.context_window
    metrics = GatewayMetrics(
        engine, extra=lambda: {f"render_{k}": v for k, v in renderer.store.stats().items()}
    )
    gw = Gateway(
        engine, tokenizer, renderer, settings, metrics, RequestLog(settings.request_log_path), context_window
    )
    gw.sessions = SessionPrefixes(max_tokens=memory_tokens)
    gw.body_limit_bytes = body_limit_bytes(context_window, settings.max_body_bytes)
    gw.max_token_chars = max_token_chars(tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        gw.log.close()

    # redirect_slashes=False: Starlette's redirect names the client's Host header; the edge
    # serves "/v1/messages/" as "/v1/messages" instead.
    app = FastAPI(
        title="ikcode gateway",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
        redirect_slashes=False,
    )
    app.state.gateway = gw
    app.add_middleware(EdgeMiddleware, gw=gw)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            return error_response(APIError(404, f"not found: {request.method} {request.url.path}"))
        if error.status_code == 405:
            return error_response(APIError(405, f"method {request.method} not allowed on {request.url.path}"))
        return error_response(APIError(error.status_code, str(error.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(invalid_request("invalid request"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return JSONResponse(error_body("api_error", "internal server error"), status_code=500)

    async def guarded(request: Request, handler: Any) -> Response:
        # Handlers raise APIError; anything else is a bug answered as a plain 500 (no traceback).
        try:
            return await handler()
        except APIError as error:
            return error_response(error)
        except Exception:
            logger.exception("unexpected error on %s", request.url.path)
            return JSONResponse(error_body("api_error", "internal server error"), status_code=500)

    @app.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        async def handler() -> Response:
            user = authenticate(gw, request)
            body = await read_model(gw, request, MessagesRequest)
            return await messages.create_message(gw, request, body, user)

        return await guarded(request, handler)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        async def handler() -> Response:
            user = authenticate(gw, request)
            body = await read_model(gw, request, CountTokensRequest)
            return await messages.count_tokens(gw, body, user)

        return await guarded(request, handler)

    add_model_routes(app, gw, guarded)

    @app.get("/health")
    async def health(request: Request) -> Response:
        # Anyone may ask whether the server is up; only a token holder sees its load and usage,
        # and only the server's own token (or anyone, without auth) every user's usage.
        try:
            user = authenticate(gw, request)
        except APIError:
            return JSONResponse({"status": "ok"})
        users = metrics.by_user()
        if user is not None and user != OWNER:
            users = {name: figures for name, figures in users.items() if name == user}
        info = engine.info
        return JSONResponse(
            {
                "status": "ok",
                "model": settings.served_model,
                "engine": info.kind,
                "device": info.device,
                "context_window": context_window,
                "block_size": info.block_size,
                "in_flight": gw.in_flight,
                "started_at": gw.started_at,
                "cache_salt_per_user": settings.salts_per_user,
                **metrics.totals(),
                "users": users,
            }
        )

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        async def handler() -> Response:
            user = authenticate(gw, request)
            # Off the event loop: the scrape asks the engine, which may answer only between steps.
            text = await run_in_threadpool(generate_latest, metrics.registry)
            if user is not None and user != OWNER:  # as /health: other users' figures are not theirs
                text = b"".join(line for line in text.splitlines(keepends=True) if PER_USER not in line)
            return Response(text, media_type=CONTENT_TYPE_LATEST)

        return await guarded(request, handler)

    return app
