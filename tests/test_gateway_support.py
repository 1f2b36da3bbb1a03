"""Helpers of the gateway tests: the tiny tokenizer, a scripted-output engine seam, idle checks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from typing import Any

from ikcode.engines.base import (
    CacheLookup,
    EngineInfo,
    EngineLoad,
    EngineRequest,
    FinishReason,
    LifecycleListener,
    RequestStream,
)
from ikcode.engines.embedded import EmbeddedEngine
from ikcode.model.tokenizer import Tokenizer

# Few merges: the tiny model's vocabulary is 300 ids (3 specials + 256 bytes + 41 merges).
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("r", "e")]


def tiny_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer.from_vocab(merges=MERGES)
    assert tokenizer.token_to_id("<|im_end|>") == 2  # the tiny model's EOS
    return tokenizer


class ScriptedEngine:
    """The real engine runs every request (KV, cache, lifecycle), but the ids handed back are a
    script: a random tiny model never writes a tool call, so this is how a test gets one."""

    def __init__(self, inner: EmbeddedEngine, script: list[int], delay_s: float = 0.0, pace_s: float = 0.0):
        self.inner = inner
        self.script = list(script)
        self.delay_s = delay_s  # hold the first event back (a long prefill, for pings)
        # Hold each later event back too: a tiny model on a fast machine writes 2,000 tokens in about
        # a second, and a test that needs a request still running later must not race it.
        self.pace_s = pace_s
        self._aborted: set[str] = set()

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    def start(self) -> None:
        self.inner.start()

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        self.inner.shutdown(drain_timeout_s)

    def submit(self, request: EngineRequest) -> RequestStream:
        sampling = dataclasses.replace(
            request.sampling, max_tokens=len(self.script), ignore_eos=True, stop_token_ids=()
        )
        inner_stream = self.inner.submit(dataclasses.replace(request, sampling=sampling))
        outer = RequestStream(request.request_id, on_abort=self.inner.abort)

        def relay() -> None:
            time.sleep(self.delay_s)
            pos = 0
            for event in inner_stream:
                time.sleep(self.pace_s)
                if request.request_id in self._aborted and not event.finished:
                    # As an engine does: an abort ends the stream with a final ABORT event, even
                    # when the inner run already finished and only the paced relay is behind.
                    for _ in inner_stream:  # to the inner final event, which carries the stats
                        pass
                    final = inner_stream.final or event
                    ended = dataclasses.replace(
                        final, token_ids=[], finished=True, finish_reason=FinishReason.ABORT
                    )
                    outer.put(ended)
                    return
                ids = self.script[pos : pos + len(event.token_ids)]
                pos += len(event.token_ids)
                reason = event.finish_reason
                if reason is FinishReason.LENGTH and pos >= len(self.script):
                    reason = FinishReason.STOP
                outer.put(dataclasses.replace(event, token_ids=ids, finish_reason=reason))

        threading.Thread(target=relay, daemon=True).start()
        return outer

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        self.inner.abort(request_id)

    def lookup(self, prompt_token_ids: list[int], cache_salt: str = "", block_hashes=None) -> CacheLookup:
        return self.inner.lookup(prompt_token_ids, cache_salt, block_hashes)

    def load(self) -> EngineLoad:
        return self.inner.load()

    def add_listener(self, listener: LifecycleListener) -> None:
        self.inner.add_listener(listener)


def wait_idle(engine: EmbeddedEngine, timeout_s: float = 10.0) -> None:
    """Nothing running or waiting, every block back (free or cached), cache invariants hold."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = engine.load()
        if load.running == 0 and load.waiting == 0 and load.kv_blocks_used == 0 and engine.idle():
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {load}, live={list(engine.scheduler.seqs)}")
        time.sleep(0.02)
    with engine._lock:
        engine.cache.check_invariants()


def hang_up_before_the_first_chunk(app: Any, body: dict, api_key: str, path: str = "/v1/messages") -> None:
    """POST `body` to the ASGI `app` from a client that is gone before the stream's first chunk:
    it hangs up as the response starts, and Starlette cancels the response before its body
    generator starts."""
    raw = json.dumps(body).encode()
    incoming = [{"type": "http.request", "body": raw, "more_body": False}]
    response_started = asyncio.Event()

    async def receive() -> dict:
        if incoming:
            return incoming.pop(0)
        await response_started.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            response_started.set()
        await asyncio.sleep(0.05)  # a slow socket: the hang-up is seen before the first chunk

    headers = [(b"content-type", b"application/json"), (b"x-api-key", api_key.encode())]
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
