"""Sending one request to a replica: pick it, connect, and on a connection failure take the
replica out and try another (the client never sees a dead replica, only at worst a 503)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import httpx
from fastapi import Request

from ikcode.auth import forwarded_session_id
from ikcode.gateway.edge import CLIENT_CLOSED, unless_client_leaves
from ikcode.gateway.errors import APIError

from .router import NoReplica, Replica, without_credentials
from .state import Upstream

logger = logging.getLogger("ikcode.upstream")

# Request headers never forwarded: hop-by-hop, sizes we recompute, the client's credentials
# for ikcode (the upstream gets its own token), and where a browser's page came from (this front
# has applied its own policy; a loopback replica would refuse a foreign Origin: same_machine.py).
_DROP_REQUEST = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "upgrade",
    "x-api-key",
    "authorization",
    "accept-encoding",
    "te",
    "proxy-authorization",
    "origin",
    "referer",
}
SESSION_HEADER = "x-claude-code-session-id"
# Response headers passed back to the client (status and error semantics live in these).
_KEEP_RESPONSE = ("content-type", "retry-after", "x-should-retry", "request-id", "x-request-id")


def upstream_headers(
    up: Upstream, incoming: Any, anthropic: bool, session_key: str | None = None
) -> dict[str, str]:
    """The headers a request goes upstream with; `session_key` is the front's key for its session
    (Upstream.session_key): where it is a user's own, the replica is given its digest
    (auth.forwarded_session_id), not the id as it came."""
    headers = {k: v for k, v in incoming.items() if k.lower() not in _DROP_REQUEST} if anthropic else {}
    if anthropic and session_key is not None:  # the id routing used (the first of several headers)
        own = session_key != incoming.get(SESSION_HEADER)
        headers[SESSION_HEADER] = forwarded_session_id(session_key) if own else session_key
    headers["content-type"] = "application/json"
    headers["accept-encoding"] = "identity"  # relay bytes as they come, no re-compression
    headers.update(up.config.headers)
    if up.config.token:
        if anthropic:
            headers["x-api-key"] = up.config.token
        headers["authorization"] = f"Bearer {up.config.token}"
    return headers


def response_headers(response: httpx.Response) -> dict[str, str]:
    out = {k: response.headers[k] for k in _KEEP_RESPONSE if k in response.headers}
    out.update({k: v for k, v in response.headers.items() if k.startswith("anthropic-")})
    return out


def logged_error(log_prompts: bool, status: int | None, body: Any) -> str:
    """What the request log keeps of an upstream's error: its status and type. Its message may
    quote the request back (vLLM's and proxies' validation errors do), so it is kept only where
    prompts may be logged (`log_prompts`); the client is given the whole answer either way."""
    if isinstance(body, (bytes, bytearray)):
        try:
            body = json.loads(body)
        except ValueError:
            body = None
    error = body.get("error", body) if isinstance(body, dict) else body
    kind = error.get("type") if isinstance(error, dict) else None
    said = "upstream" + (f" {status}" if status else "") + (f" {str(kind)[:60]}" if kind else " error")
    if log_prompts and error is not None:
        message = error.get("message", error) if isinstance(error, dict) else error
        said += f": {str(message)[:500]}"
    return said


def prefix_key(body: dict[str, Any]) -> str:
    """A conversation's stable start: system prompt and first message (Claude Code's attribution
    line differs per conversation, which is fine here: it is a key, not a shared prefix)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(body.get("system")).encode())
    messages = body.get("messages") or []
    if isinstance(messages, list) and messages:
        h.update(repr(messages[0]).encode()[:8192])
    return h.hexdigest()


async def open_stream(
    up: Upstream,
    client: Request,
    path: str,
    content: bytes,
    headers: dict[str, str],
    session_id: str | None,
    key: str,
) -> tuple[Replica, httpx.Response, int]:
    """The first replica that answers (headers received), its response (not yet read) and the
    number of attempts; NoReplica when none does. A server sends a whole answer's headers only
    with the answer: a client that hangs up meanwhile is a 499 and the replica's request is closed
    (`unless_client_leaves`)."""
    tried: set[str] = set()
    attempts = 0
    resent = 0  # retries of a request a replica may have received (and begun working on)
    while attempts <= up.config.retries + len(up.router.replicas):
        replica = up.router.pick(session_id, key, tried)
        attempts += 1
        outgoing = up.http().build_request("POST", replica.url + path, content=content, headers=headers)
        try:
            response = await unless_client_leaves(client, up.http().send(outgoing, stream=True))
            return replica, response, attempts
        except (httpx.ConnectError, httpx.ConnectTimeout) as err:
            up.router.release(replica)
            up.router.mark_down(replica, f"{type(err).__name__}: {err}")
            logger.warning(
                "replica %s (%s) is down: %s; retrying elsewhere",
                replica.name, replica.shown_url, without_credentials(str(err)),
            )  # fmt: skip
        except httpx.TimeoutException:
            up.router.release(replica)
            raise timed_out(up) from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as err:
            # Closed before answering (a stale keep-alive connection or a dying server): the
            # request may have reached it, and a whole answer's headers come only with the
            # answer, so a retry elsewhere may repeat its work: at most `retries` of them (a
            # refused connection, above, delivered nothing and is retried on any replica left).
            up.router.release(replica)
            reason = without_credentials(str(err))
            resent += 1
            if resent > up.config.retries:
                logger.warning("replica %s closed the connection: %s; no retries left", replica.name, reason)
                why = f"the upstream replica closed the connection without answering ({reason})"
                raise NoReplica(why) from None
            logger.warning("replica %s closed the connection: %s; retrying elsewhere", replica.name, reason)
        except BaseException:
            up.router.release(replica)
            raise
        tried.add(replica.url)
        up.metrics.retries.inc()
        if len(tried) >= len(up.router.replicas):
            break
    raise NoReplica("every upstream replica failed to answer")


def timed_out(up: Upstream) -> APIError:
    """What the client gets when the replica stays silent past the read timeout (retryable)."""
    return APIError(504, f"the upstream server did not answer within {up.config.read_timeout_s:g} s")


async def read_answer(up: Upstream, request: Request, replica: Replica, response: httpx.Response) -> bytes:
    """A whole (non-streamed) answer. APIError 499 when the client hangs up first: the upstream
    connection is closed then, which stops the replica's work, instead of read to the end for
    nobody; 504 when the replica stays silent past the read timeout."""
    try:
        return await unless_client_leaves(request, response.aread())
    except httpx.TimeoutException:
        raise timed_out(up) from None
    except httpx.HTTPError as err:  # the connection failed in the middle of the answer
        up.router.mark_down(replica, f"answer cut: {type(err).__name__}")
        raise APIError(
            529, f"the upstream server failed in the middle of its answer ({type(err).__name__}); retry"
        ) from None
    finally:
        await aclose_quietly(response)
        up.router.release(replica)


class SSEScanner:
    """Splits relayed SSE bytes into (event, data) pairs without touching what is relayed."""

    def __init__(self) -> None:
        self.buffer = b""
        self.event = ""
        self.data: list[bytes] = []

    def feed(self, chunk: bytes) -> Iterator[tuple[str, bytes]]:
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            line = line.rstrip(b"\r")
            if not line:
                if self.data or self.event:
                    yield self.event, b"\n".join(self.data)
                self.event, self.data = "", []
            elif line.startswith(b"event:"):
                self.event = line[6:].strip().decode("utf-8", "replace")
            elif line.startswith(b"data:"):
                self.data.append(line[5:].strip())


async def aclose_quietly(response: httpx.Response) -> None:
    try:
        await response.aclose()
    except Exception:  # closing a broken connection must not hide the real outcome
        pass


class StreamEnd:
    """The end of one relayed stream, run once: by the relay's `finally`, or by the response when
    the client left before the relay started (a generator that never started runs no `finally`)."""

    def __init__(self, up: Upstream, replica: Replica, response: httpx.Response, user: str | None):
        self.up = up
        self.replica = replica
        self.response = response
        self.user = user
        self.done = False

    async def __call__(self, finish: Callable[[], None]) -> None:
        if self.done:
            return
        self.done = True
        # Book-keeping first: under cancellation (a client that hung up) the await below would
        # raise again and skip anything after it.
        self.up.router.release(self.replica)
        self.up.stream_ended(self.user)
        finish()
        with anyio.CancelScope(shield=True):
            await aclose_quietly(self.response)


def stream_outcome(record: dict[str, Any]) -> int:
    """The status a relayed stream counts under once closed (ClosingStreamingResponse.outcome):
    answered, its client left (499), or the replica failed it (529, as the error event said)."""
    error = record.get("error")
    if not error:
        return 200
    return CLIENT_CLOSED if error == "client disconnected" else 529


async def iterate(response: httpx.Response) -> AsyncIterator[bytes]:
    async for chunk in response.aiter_raw():
        yield chunk
