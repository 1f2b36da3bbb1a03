"""Keep a stream alive while the upstream is silent (a long prefill): Claude Code abandons a
stream after 300 s without an event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def with_pings(source: AsyncIterator[T], interval_s: float) -> AsyncIterator[T | None]:
    """Items of `source`, and None each time `interval_s` passes without one."""
    iterator = source.__aiter__()
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()
