"""The edge both front apps share (the gateway over an engine, the upstream front over servers):
path prefixes, body size, request counting, auth, strict body parsing, the model card.

They take any state with `settings` (GatewaySettings), `metrics.requests` (a labelled Counter)
and `context_window`: the gateway's `Gateway` and the upstream's `Upstream` both qualify.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from ikcode.auth import OWNER, tokens_equal
from ikcode.gateway.errors import APIError, invalid_request
from ikcode.gateway.same_machine import foreign_request, same_machine_only
from ikcode.gateway.settings import GatewaySettings
from ikcode.gateway.sse import OUTCOME_KEY

CLIENT_CLOSED = 499  # the status logged for a request whose client left before its answer
KNOWN_ROUTES = ("/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/health", "/metrics", "/")
# Routes outside /v1/ that a base URL with a path prefix also reaches (`ikcode up` waits on
# {base_url}/health).
ROOT_ROUTES = ("/health", "/metrics")


class EdgeState(Protocol):
    settings: GatewaySettings
    metrics: Any  # has .requests: Counter labelled (route, status)
    context_window: int


class EdgeMiddleware:
    """Path prefix stripping, the same-machine check of a loopback server (same_machine.py), the
    Content-Length size check and request counting, in one pass."""

    def __init__(self, app: ASGIApp, gw: EdgeState):
        self.app = app
        self.gw = gw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if not path.startswith("/v1/") and "/v1/" in path:  # http://host/prefix/v1/messages
            path = path[path.index("/v1/") :]
        elif path.endswith(ROOT_ROUTES) and path not in ROOT_ROUTES:  # http://host/prefix/health
            path = path[path.rindex("/") :]
        elif scope["method"] == "HEAD" and "/v1/" not in path:  # HEAD {ANTHROPIC_BASE_URL}
            path = "/"
        if len(path) > 1 and path.endswith("/"):  # a base URL with a trailing slash
            path = path.rstrip("/") or "/"
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
                headers = list(message.get("headers") or [])
                # Every answer names itself, as Anthropic's do (the SDK's `request_id`), unless an
                # upstream's own id is being passed on.
                if not any(name.lower() == b"request-id" for name, _ in headers):
                    headers.append((b"request-id", f"req_{secrets.token_hex(12)}".encode()))
                    message = {**message, "headers": headers}
            await send(message)

        length = dict(scope.get("headers") or []).get(b"content-length")
        try:
            local = same_machine_only(self.gw.settings)
            refused = foreign_request(scope.get("headers") or []) if local else None
            if refused is not None:
                return await error_response(APIError(403, refused))(scope, receive, counting_send)
            if length is not None and length.isdigit() and int(length) > body_limit(self.gw):
                response = error_response(too_large(self.gw))
                return await response(scope, receive, counting_send)
            await self.app(scope, receive, counting_send)
        finally:
            code = (scope.get("state") or {}).get(OUTCOME_KEY, status["code"])
            self.gw.metrics.requests.labels(route, str(code)).inc()


def body_limit(gw: EdgeState) -> int:
    """The body size limit: the gateway's own (derived from its context window), else the setting."""
    return getattr(gw, "body_limit_bytes", None) or gw.settings.max_body_bytes


def too_large(gw: EdgeState) -> APIError:
    return APIError(413, f"request body is larger than {body_limit(gw)} bytes")


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


# A whole request body must arrive within this long. The per-user caps count a request only once
# its body is read: without a deadline, bodies that trickle in hold connections for ever.
BODY_READ_TIMEOUT_S = 60.0


async def read_body(request: Request, limit: int, too_large: Callable[[], APIError]) -> bytes:
    """The body, size-checked while it streams in, within BODY_READ_TIMEOUT_S (past it a 400, as
    Anthropic's API answers a body that did not finish arriving in time: `request_body_timeout`). A
    client that hangs up before sending all of it is a 499 (nobody reads it; logged and counted
    as the client's doing, not as a server error)."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large()
                chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(CLIENT_CLOSED, "the client disconnected while sending its request") from None
    except TimeoutError:
        seconds = f"{BODY_READ_TIMEOUT_S:.0f} s"
        raise APIError(400, f"the request body did not finish arriving within {seconds}") from None
    return b"".join(chunks)


async def client_disconnected(request: Request) -> None:
    """Returns when the client hangs up. Only once its body has been read: the next message the
    server receives is then the disconnect. Starlette watches for it on streamed answers only."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


T = TypeVar("T")


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """work's result; APIError(499) as soon as the client hangs up first, with work cancelled (an
    upstream read closed, a queue place given back) instead of finished for nobody."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(client_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(CLIENT_CLOSED, "client disconnected")
    finally:
        for pending in (task, gone):
            pending.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)


async def read_model(gw: EdgeState, request: Request, model: type[BaseModel]) -> Any:
    """The body, size-checked while it streams in, parsed strictly, validated into `model`."""
    raw = await read_body(request, body_limit(gw), lambda: too_large(gw))
    # What the parsed request will hold in memory, for whatever keeps it past the request (the
    # renderer's previous renders: an image is a few tokens but megabytes of base64).
    request.state.body_bytes = len(raw)
    try:
        # pydantic parses the bytes itself (far faster than json.loads on multi-megabyte bodies).
        return model.model_validate_json(raw)
    except ValidationError as error:
        if any(e.get("type") == "json_invalid" for e in error.errors(include_input=False, include_url=False)):
            raise invalid_request("request body is not valid JSON") from None
        if any(e.get("type") == "model_type" and not e.get("loc") for e in error.errors(include_url=False)):
            raise invalid_request("request body must be a JSON object") from None
        raise invalid_request(validation_message(error)) from None
    except (ValueError, RecursionError):
        raise invalid_request("request body is not valid JSON or is nested too deeply") from None


def validation_message(error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_input=False, include_url=False)[:3]:
        where = ".".join(str(p) for p in item.get("loc", ())) or "body"
        # Locations and messages can quote the client's own strings (a block's `type`): clipped.
        parts.append(f"{where[:200]}: {str(item.get('msg', 'invalid'))[:300]}")
    more = error.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def authenticate(gw: EdgeState, request: Request) -> str | None:
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
            if tokens_equal(candidate, token):
                match = name
    if match is None:
        raise APIError(401, "invalid authentication token")
    return match


def model_info(gw: EdgeState, model_id: str) -> dict[str, Any]:
    return {
        "type": "model",
        "id": model_id,
        "display_name": gw.settings.display_name or gw.settings.served_model,
        "created_at": "2025-01-01T00:00:00Z",
        "context_window": gw.context_window,
        "max_input_tokens": gw.context_window,
        "max_tokens": gw.settings.max_output_tokens,
        "max_output_tokens": gw.settings.max_output_tokens,
        "lifecycle": "active",  # required by the SDK's ModelInfo
    }


MAX_ECHO_CHARS = 200  # of a client's string put in an error message or the request log


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """text, cut to limit characters: a 10 MB model name must not be echoed or logged whole."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def clip_session(session_id: str | None) -> str | None:
    """A session id as the request log keeps it: a client's header (Claude Code's are UUIDs)."""
    return None if session_id is None else clip(session_id, 128)


def check_model(gw: EdgeState, model: str) -> None:
    if not gw.settings.accepts(model):
        raise APIError(404, f"model: {clip(model)} (this server serves {gw.settings.served_model})")


def check_concurrency(
    settings: GatewaySettings, in_flight: int, in_flight_by_user: Mapping[str, int], user: str | None
) -> None:
    """429 with a retry-after when the server, or this token, has as many requests running as
    it may (max_concurrent_requests, max_requests_per_user)."""
    limit = settings.max_concurrent_requests
    if limit is not None and in_flight >= limit:
        raise APIError(429, f"too many concurrent requests (limit {limit})", retry_after_s=1)
    per_user = settings.max_requests_per_user
    # The server's own token is the operator's (its benches, its sessions): not capped.
    if per_user is not None and user != OWNER and in_flight_by_user.get(user or "", 0) >= per_user:
        message = f"too many concurrent requests for this token (limit {per_user})"
        raise APIError(429, message, retry_after_s=1)


def check_max_tokens(gw: EdgeState, max_tokens: int) -> None:
    """400 for a max_tokens under 1 or over the profile's max_output_tokens (Anthropic's wording):
    what a reply may cost is bounded before it is asked for."""
    limit = gw.settings.max_output_tokens
    if max_tokens < 1:
        raise invalid_request(f"max_tokens: must be at least 1, got {max_tokens}")
    if max_tokens > limit:
        raise invalid_request(
            f"max_tokens: {max_tokens} > {limit}, which is the maximum allowed number of output "
            f"tokens for {gw.settings.served_model}"
        )


Guard = Callable[[Request, Callable[[], Awaitable[Response]]], Awaitable[Response]]


def add_model_routes(app: FastAPI, gw: EdgeState, guarded: Guard) -> None:
    """GET /v1/models, /v1/models/{id} and the root (Claude Code sends HEAD / at start)."""

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        async def handler() -> Response:
            authenticate(gw, request)
            info = model_info(gw, gw.settings.served_model)
            return JSONResponse(
                {"data": [info], "has_more": False, "first_id": info["id"], "last_id": info["id"]}
            )

        return await guarded(request, handler)

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> Response:
        async def handler() -> Response:
            authenticate(gw, request)
            check_model(gw, model_id)
            return JSONResponse(model_info(gw, model_id))

        return await guarded(request, handler)

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        return JSONResponse({"status": "ok"})
