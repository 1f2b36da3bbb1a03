"""uvicorn's HTTP/1.1 protocol with a deadline on each request's head (request line and headers).

uvicorn has no such deadline: its keep-alive timer covers only the idle time between requests and
is reset by every byte received (h11_impl.py, `data_received` first cancels it), so a client that
trickles a request head one byte at a time holds its connection for ever, before any ASGI code
(the auth check, the per-user caps, edge.BODY_READ_TIMEOUT_S for the body) can see it. A few
hundred such connections hold a server's file descriptors without a token (slowloris).

Here a connection must deliver a whole request head within HEAD_READ_TIMEOUT_S of opening, and of
its previous response ending; else it is closed. A request whose head arrived is left to the app
(its body has its own deadline, its answer may stream for minutes).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_READ_TIMEOUT_S = 20.0  # Go's net/http servers commonly set ReadHeaderTimeout to 2-30 s


class HeadDeadlineProtocol(H11Protocol):
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived: its cycle has started
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        # Armed before uvicorn goes on to a pipelined request, whose head then disarms it.
        if not self.transport.is_closing():
            self._arm_head_timer()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(HEAD_READ_TIMEOUT_S, self._head_too_slow)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_head and not self.transport.is_closing():
            self.logger.info("closed a connection: no request head within %.0f s", HEAD_READ_TIMEOUT_S)
            self.transport.close()
