"""Shutting a gateway down without losing an answer: drain for a deadline, then cut what is left.

On SIGTERM the server stops accepting connections, refuses new requests on open ones (529, retry),
waits up to `timeout_s` for the running ones to finish, then cuts the rest: each gets Anthropic's
overloaded error (a JSON body, or an error event in its stream) and its request-log line. Only then
does uvicorn close connections, so it has nothing left to cancel (no CancelledError tracebacks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ikcode.gateway.errors import APIError

logger = logging.getLogger(__name__)

# After the cut, how long the cut requests get to write their answers and log lines.
CUT_GRACE_S = 5.0
POLL_S = 0.05


def check_draining(server: Any) -> None:
    """529 + retry for a request arriving while the server drains (a gateway or an upstream front)."""
    if server.draining:
        raise APIError(529, "the server is shutting down; retry shortly", retry_after_s=5)


async def _wait_idle(gw: Any, deadline: float) -> None:
    while gw.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)


async def drain(gw: Any, timeout_s: float) -> None:
    """gw: what a server's app holds (`draining`, `in_flight`; a gateway's `generations` can be
    cut, an upstream front's relayed streams are left to uvicorn after the deadline)."""
    gw.draining = True
    running = gw.in_flight
    if running:
        logger.info("draining %d request(s) for up to %.0f s", running, timeout_s)
    await _wait_idle(gw, time.monotonic() + max(0.0, timeout_s))
    if not gw.in_flight:
        return
    logger.warning("drain deadline of %.0f s reached: cutting %d request(s)", timeout_s, gw.in_flight)
    gw.cutting = True  # a request still in its submit is cut when its Generation starts
    for generation in list(getattr(gw, "generations", {}).values()):
        generation.cut()
    await _wait_idle(gw, time.monotonic() + CUT_GRACE_S)
    if gw.in_flight:
        logger.warning("%d request(s) still open after the cut", gw.in_flight)
