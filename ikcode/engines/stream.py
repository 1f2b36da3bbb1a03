"""The stream a caller reads, fed by the engine thread.

Engines run their step loop on a thread of their own and the gateway lives on an event loop, so
the stream can be read from a plain thread (`for event in stream`) or from asyncio
(`async for event in stream`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from ikcode.engines.events import TokenEvent

_END = object()


class RequestStream:
    """Thread-safe hand-off of TokenEvents from an engine thread to one reader.

    The engine calls `put(event)`; a reader iterates synchronously or asynchronously. The stream
    ends after the event with finished=True. `abort()` asks the engine to stop the request; the
    engine still delivers a final event (finish_reason=ABORT) so that nothing is left open.
    """

    def __init__(self, request_id: str, on_abort: Callable[[str], None] | None = None):
        self.request_id = request_id
        self._q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._on_abort = on_abort
        self._closed = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aq: asyncio.Queue[object] | None = None
        self._lock = threading.Lock()
        self.final: TokenEvent | None = None

    # -- engine side --------------------------------------------------------------------------
    def put(self, event: TokenEvent) -> None:
        if self._closed.is_set():
            return
        if event.finished:
            self.final = event
            self._closed.set()
        # Under the lock: an async reader attaching between our look at _loop and a put into
        # _q would drain _q first and then never see this event.
        with self._lock:
            loop, aq = self._loop, self._aq
            if loop is None or aq is None:
                self._q.put(event)
                return
        try:
            loop.call_soon_threadsafe(aq.put_nowait, event)
        except RuntimeError:  # the reader's loop is gone; nobody is listening
            pass

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # -- reader side --------------------------------------------------------------------------
    def abort(self) -> None:
        if self._on_abort is not None and not self._closed.is_set():
            self._on_abort(self.request_id)

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            event = self._q.get()
            assert isinstance(event, TokenEvent)
            yield event
            if event.finished:
                return

    def collect(self, timeout_s: float | None = None) -> tuple[list[int], TokenEvent]:
        """Read to the end; return all token ids and the final event (tests, simple callers)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        tokens: list[int] = []
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                event = self._q.get(timeout=remaining)
            except queue.Empty:
                self.abort()
                raise TimeoutError(f"request {self.request_id} did not finish in {timeout_s} s") from None
            assert isinstance(event, TokenEvent)
            tokens.extend(event.token_ids)
            if event.finished:
                return tokens, event

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        aq: asyncio.Queue[object] = asyncio.Queue()
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._aq = aq
            # Events that arrived before the reader attached.
            while True:
                try:
                    aq.put_nowait(self._q.get_nowait())
                except queue.Empty:
                    break
        while True:
            event = await aq.get()
            assert isinstance(event, TokenEvent)
            yield event
            if event.finished:
                return
