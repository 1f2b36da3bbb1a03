"""RequestStream: the hand-off between an engine thread and a sync or async reader."""

from __future__ import annotations

import asyncio
import queue
import threading

from ikcode.engines.base import RequestStream, TokenEvent


class _RecordingQueue(queue.SimpleQueue):
    """Notes whether the stream held its lock at each put into the pre-attach queue."""

    def __init__(self, stream: RequestStream):
        super().__init__()
        self.stream = stream
        self.locked_at_put: list[bool] = []

    def put(self, item, block=True, timeout=None):  # noqa: ANN001 - queue.SimpleQueue's signature
        self.locked_at_put.append(self.stream._lock.locked())
        super().put(item, block, timeout)


def test_pre_attach_put_happens_under_the_lock():
    # An async reader attaches under the lock and drains the queue; a put that checked for a
    # reader and then queued outside the lock could land after the drain and be lost.
    stream = RequestStream("r")
    rec = _RecordingQueue(stream)
    stream._q = rec
    stream.put(TokenEvent("r", [1]))
    stream.put(TokenEvent("r", [2], finished=True))
    assert rec.locked_at_put == [True, True]


def test_async_reader_attaching_while_the_engine_puts_sees_every_event():
    async def read(stream: RequestStream, started: threading.Event) -> list[int]:
        started.set()
        out: list[int] = []
        async for event in stream:
            out.extend(event.token_ids)
        return out

    async def main() -> None:
        for _ in range(200):
            stream = RequestStream("r")
            started = threading.Event()

            def produce(stream: RequestStream = stream, started: threading.Event = started) -> None:
                started.wait()
                for i in range(20):
                    stream.put(TokenEvent("r", [i]))
                stream.put(TokenEvent("r", [20], finished=True))

            t = threading.Thread(target=produce)
            t.start()
            tokens = await asyncio.wait_for(read(stream, started), timeout=5)
            t.join()
            assert tokens == list(range(21))

    asyncio.run(main())
