"""Serving an app with uvicorn: in the foreground (the daemon) or on a thread (tests, tools)."""

from __future__ import annotations

import gc
import signal
import socket
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from uvicorn.server import HANDLED_SIGNALS

from ikcode.gateway.drain import CUT_GRACE_S, drain
from ikcode.gateway.head_deadline import HeadDeadlineProtocol


def _config(app: FastAPI, host: str, port: int, log_level: str, graceful_timeout_s: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,  # the gateway writes its own request log, without prompt text
        timeout_graceful_shutdown=graceful_timeout_s,  # in-flight streams get this long on SIGTERM
        lifespan="on",
        http=HeadDeadlineProtocol,  # h11, with a deadline on each request head (head_deadline.py)
        ws="none",  # no WebSocket routes: an upgrade request is answered as plain HTTP
    )


# A request allocates tens of thousands of small objects (parsed blocks); with the default
# threshold of 700 a long conversation's parse triggers several young collections, and every few
# of those an older one that walks the conversation store. Fewer, larger young generations keep
# the collector out of the request path; cycles are still collected.
GC_THRESHOLDS = (50_000, 20, 20)


def tune_garbage_collector() -> None:
    """Freeze what lives as long as the process and collect young objects less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class DrainingServer(uvicorn.Server):
    """uvicorn that, on its way down, first drains the gateway (gateway.drain) for a timeout read
    when the signal arrives (`ikcode down --timeout` writes it), so every request is answered."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout_s: Callable[[], float]):
        super().__init__(config)
        self.app = app
        self.drain_timeout_s = drain_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # stop accepting first, as uvicorn would
            server.close()
        # The embedded gateway, or an upstream front (which drains its relayed streams alike).
        gw = getattr(self.app.state, "gateway", None) or getattr(self.app.state, "upstream", None)
        if gw is not None:
            await drain(gw, self.drain_timeout_s())
        await super().shutdown(sockets)


def run_server(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8080,
    log_level: str = "info",
    graceful_timeout_s: int = 30,
    drain_timeout_s: Callable[[], float] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM, then stop accepting, let requests finish (up to the drain
    timeout, default graceful_timeout_s), answer what is left with an error, and return."""
    # The model, tokenizer and caches live as long as the process: move them out of the garbage
    # collector's generations, or each full collection walks them (100+ ms pauses on long prompts).
    tune_garbage_collector()
    # uvicorn's own wait comes after the drain: by then only idle connections are left.
    config = _config(app, host, port, log_level, graceful_timeout_s=int(CUT_GRACE_S) + 1)
    server = DrainingServer(config, app, drain_timeout_s or (lambda: float(graceful_timeout_s)))

    # uvicorn re-raises the signal it caught once it is done, to exit with it: the caller still
    # has an engine to stop and a pid file to clear, so that second delivery only asks (again) for
    # the exit under way. One that comes before uvicorn's own handler is in place is not lost.
    def stop(*_: object) -> None:
        server.should_exit = True

    quiet = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, stop) for sig in HANDLED_SIGNALS} if quiet else {}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class BackgroundServer:
    """uvicorn on a daemon thread; `port=0` picks a free port (read `.port` after start)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.server = uvicorn.Server(_config(app, host, port, log_level, graceful_timeout_s=5))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.server.run, name="ikcode-gateway", daemon=True)
        self.host = host
        self.port = port

    def start(self, timeout_s: float = 10.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway server did not start")
            time.sleep(0.01)
        sockets = [s for server in self.server.servers for s in server.sockets]
        self.port = sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
