"""Server-sent events in the Anthropic stream format: `event: <type>` then `data: <json>`."""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

# Response headers of every event stream: no caching, no proxy buffering (nginx).
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
PING = b'event: ping\ndata: {"type": "ping"}\n\n'


def sse_event(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


# Where a stream leaves the status to count it under (the edge's request counter reads it).
OUTCOME_KEY = "ikcode_outcome_status"


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` once it is done with the client, however it ends.

    A stream's cleanup cannot live only in its generator's `finally`: when the client hangs up
    before the first chunk is asked for, Starlette cancels the response and the generator never
    starts, so its `finally` never runs (the engine request, the upstream connection and the
    in-flight count would leak). `on_close` must be idempotent: the generator's own `finally`
    usually runs it first.
    """

    def __init__(
        self,
        content: AsyncIterable[bytes],
        on_close: Callable[[], Awaitable[None] | None],
        outcome: Callable[[], int] | None = None,
        **kwargs: Any,
    ):
        super().__init__(content, **kwargs)
        self.on_close = on_close
        self.outcome = outcome

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # runs even while this task is being cancelled
                result = self.on_close()
                if inspect.isawaitable(result):
                    await result
            if self.outcome is not None:
                # The status sent was 200 before the stream began; how it ended is what counts.
                scope.setdefault("state", {})[OUTCOME_KEY] = self.outcome()
