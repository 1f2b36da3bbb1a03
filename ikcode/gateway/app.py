"""The FastAPI app: Anthropic Messages API over any Engine.

`create_app(engine, tokenizer, settings)` builds it without a socket (tests use it in-process);
`ikcode.gateway.server.run_server` serves it with uvicorn. Every error leaves in Anthropic's
shape; unknown request fields and beta flags are accepted; a base-URL path prefix is stripped.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ikcode.engines.base import Engine
from ikcode.gateway import messages
from ikcode.gateway.chat_format import TokenizerLike
from ikcode.gateway.errors import APIError, error_body, invalid_request
from ikcode.gateway.metrics import GatewayMetrics
from ikcode.gateway.render import Renderer
from ikcode.gateway.request_log import RequestLog
from ikcode.gateway.schemas import CountTokensRequest, MessagesRequest
from ikcode.gateway.settings import GatewaySettings
from ikcode.gateway.state import Gateway

logger = logging.getLogger("ikcode.gateway")
KNOWN_ROUTES = ("/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/health", "/metrics", "/")


class _EdgeMiddleware:
    """Path prefix stripping, the Content-Length size check and request counting, in one pass."""

    def __init__(self, app: ASGIApp, gw: Gateway):
        self.app = app
        self.gw = gw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if not path.startswith("/v1/") and "/v1/" in path:  # http://host/prefix/v1/messages
            path = path[path.index("/v1/") :]
        elif scope["method"] == "HEAD" and "/v1/" not in path:  # HEAD {ANTHROPIC_BASE_URL}
            path = "/"
        if path != scope["path"]:
            scope = dict(scope, path=path, raw_path=path.encode())
        route = (
            path
            if path in KNOWN_ROUTES
            else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        )
        status = {"code": 500}

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        length = dict(scope.get("headers") or []).get(b"content-length")
        try:
            if length is not None and length.isdigit() and int(length) > self.gw.settings.max_body_bytes:
                response = _error_response(_too_large(self.gw))
                return await response(scope, receive, counting_send)
            await self.app(scope, receive, counting_send)
        finally:
            self.gw.metrics.requests.labels(route, str(status["code"])).inc()


def _too_large(gw: Gateway) -> APIError:
    return APIError(413, f"request body is larger than {gw.settings.max_body_bytes} bytes")


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


async def _read_model(gw: Gateway, request: Request, model: type[BaseModel]) -> Any:
    """The body, size-checked while it streams in, parsed strictly, validated into `model`."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > gw.settings.max_body_bytes:
            raise _too_large(gw)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        # pydantic parses the bytes itself (far faster than json.loads on multi-megabyte bodies).
        return model.model_validate_json(raw)
    except ValidationError as error:
        if any(e.get("type") == "json_invalid" for e in error.errors(include_input=False, include_url=False)):
            raise invalid_request("request body is not valid JSON") from None
        if any(e.get("type") == "model_type" and not e.get("loc") for e in error.errors(include_url=False)):
            raise invalid_request("request body must be a JSON object") from None
        raise invalid_request(_validation_message(error)) from None
    except (ValueError, RecursionError):
        raise invalid_request("request body is not valid JSON or is nested too deeply") from None


def _validation_message(error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_input=False, include_url=False)[:3]:
        where = ".".join(str(p) for p in item.get("loc", ())) or "body"
        parts.append(f"{where}: {item.get('msg', 'invalid')}")
    more = error.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _authenticate(gw: Gateway, request: Request) -> str | None:
    """The name of the token presented, None when auth is off; 401 otherwise."""
    tokens = gw.settings.auth_tokens
    if not tokens:
        return None
    presented = [request.headers.get("x-api-key", "")]
    authorization = request.headers.get("authorization", "")
    if authorization[:7].lower() == "bearer ":
        presented.append(authorization[7:].strip())
    presented = [p for p in presented if p]
    if not presented:
        raise APIError(401, "missing credentials: send x-api-key or Authorization: Bearer <token>")
    match = None
    for name, token in tokens.items():  # compare against every token: no early exit
        for candidate in presented:
            if hmac.compare_digest(candidate.encode(), token.encode()):
                match = name
    if match is None:
        raise APIError(401, "invalid authentication token")
    return match


def _model_info(gw: Gateway, model_id: str) -> dict[str, Any]:
    return {
        "type": "model",
        "id": model_id,
        "display_name": gw.settings.display_name or gw.settings.served_model,
        "created_at": "2025-01-01T00:00:00Z",
        "context_window": gw.context_window,
        "max_input_tokens": gw.context_window,
        "max_tokens": gw.settings.max_output_tokens,
        "max_output_tokens": gw.settings.max_output_tokens,
    }


def create_app(
    engine: Engine,
    tokenizer: TokenizerLike,
    settings: GatewaySettings,
    renderer: Renderer | None = None,
) -> FastAPI:
    settings.validate()
    renderer = renderer or Renderer(tokenizer)
    context_window = settings.context_window or engine.info.context_window
    metrics = GatewayMetrics(
        engine, extra=lambda: {f"render_{k}": v for k, v in renderer.store.stats().items()}
    )
    gw = Gateway(
        engine, tokenizer, renderer, settings, metrics, RequestLog(settings.request_log_path), context_window
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        gw.log.close()

    app = FastAPI(title="ikcode gateway", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.gateway = gw
    app.add_middleware(_EdgeMiddleware, gw=gw)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            return _error_response(APIError(404, f"not found: {request.method} {request.url.path}"))
        if error.status_code == 405:
            return _error_response(
                APIError(405, f"method {request.method} not allowed on {request.url.path}")
            )
        return _error_response(APIError(error.status_code, str(error.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return _error_response(invalid_request("invalid request"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return JSONResponse(error_body("api_error", "internal server error"), status_code=500)

    async def guarded(request: Request, handler: Any) -> Response:
        # Handlers raise APIError; anything else is a bug answered as a plain 500 (no traceback).
        try:
            return await handler()
        except APIError as error:
            return _error_response(error)
        except Exception:
            logger.exception("unexpected error on %s", request.url.path)
            return JSONResponse(error_body("api_error", "internal server error"), status_code=500)

    @app.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        async def handler() -> Response:
            user = _authenticate(gw, request)
            body = await _read_model(gw, request, MessagesRequest)
            return await messages.create_message(gw, request, body, user)

        return await guarded(request, handler)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        async def handler() -> Response:
            _authenticate(gw, request)
            body = await _read_model(gw, request, CountTokensRequest)
            return await messages.count_tokens(gw, body)

        return await guarded(request, handler)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        async def handler() -> Response:
            _authenticate(gw, request)
            info = _model_info(gw, settings.served_model)
            return JSONResponse(
                {"data": [info], "has_more": False, "first_id": info["id"], "last_id": info["id"]}
            )

        return await guarded(request, handler)

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> Response:
        async def handler() -> Response:
            _authenticate(gw, request)
            messages.check_model(gw, model_id)
            return JSONResponse(_model_info(gw, model_id))

        return await guarded(request, handler)

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/health")
    async def health() -> Response:
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
                **metrics.totals(),
            }
        )

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        async def handler() -> Response:
            _authenticate(gw, request)
            return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

        return await guarded(request, handler)

    return app
