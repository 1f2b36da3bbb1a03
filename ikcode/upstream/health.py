"""Health checks: a replica that does not answer is taken out; one that answers again comes back.

Any HTTP answer counts as alive (a 401 or 404 still proves the server is there); only a failed
connection or a timeout takes a replica out. Requests take a replica out too, on a failed
connection, without waiting for the next check. A replica with requests in flight is not probed:
its answers prove it alive (a failed one takes it out), and a probe can hurt it: single-slot
servers answer /models only between generations, and llama-cpp-python ends a running stream when
any other request arrives. A probe that connects but times out while requests run counts as busy.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from .router import without_credentials
from .state import Upstream

logger = logging.getLogger("ikcode.upstream")


def health_url(up: Upstream, url: str) -> str:
    return url + ("/models" if up.config.kind == "openai" else "/health")


async def check_once(up: Upstream) -> None:
    def _down(replica, err: Exception) -> None:
        if replica.healthy:
            logger.warning(
                "replica %s (%s) failed its health check: %s",
                replica.name, replica.shown_url, without_credentials(str(err)),
            )  # fmt: skip
        up.router.mark_down(replica, f"health check: {type(err).__name__}")

    async def probe(replica) -> None:
        if replica.healthy and replica.in_flight > 0:
            return
        try:
            await up.http().get(health_url(up, replica.url), timeout=min(5.0, up.config.health_interval_s))
        except (httpx.ReadTimeout, httpx.PoolTimeout) as err:
            if replica.in_flight > 0:
                logger.debug("replica %s is busy (%s); keeping it", replica.name, type(err).__name__)
                return
            _down(replica, err)
            return
        except (httpx.HTTPError, OSError) as err:
            _down(replica, err)
            return
        if not replica.healthy:
            logger.info("replica %s (%s) is back", replica.name, replica.shown_url)
            up.router.mark_up(replica)

    await asyncio.gather(*(probe(r) for r in up.router.replicas))


async def health_loop(up: Upstream) -> None:
    while True:
        try:
            await check_once(up)
        except Exception:  # a bug in one round must not stop the checks
            logger.exception("health check round failed")
        await asyncio.sleep(up.config.health_interval_s)
