"""AdmissionController: an Engine that wraps an Engine and decides when requests enter it.

The gateway talks to it exactly as to any engine. submit() looks the prompt up in the engine's
cache, classifies it, may shed it (EngineOverloaded: the gateway answers 529 + retry-after),
and otherwise queues it; a dispatcher thread hands queued requests to the wrapped engine when
the policy allows, and forwards the engine's events into the stream the caller already holds.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable
from hashlib import blake2b
from typing import Any

from ikcode.engines.base import (
    CacheLookup,
    EmptyPrompt,
    Engine,
    EngineError,
    EngineInfo,
    EngineLoad,
    EngineRequest,
    EngineShutdown,
    FinishReason,
    LifecycleEvent,
    LifecycleKind,
    LifecycleListener,
    PromptBlockHashes,
    RequestStream,
    TokenEvent,
)

from .config import AdmissionConfig
from .gate import RankGate, num_ranks
from .policy import AdmissionPolicy, Ticket
from .sessions import SessionLimit


class AdmissionController:
    def __init__(
        self,
        engine: Engine,
        config: AdmissionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        session_limit: SessionLimit | None = None,
    ):
        """session_limit: the most sessions active at once for a conversation size (the serving
        stack passes ikcode.plan.session_limit for a profile with [hardware] figures)."""
        self.engine = engine
        self.policy = AdmissionPolicy(config, session_limit)
        self.policy.num_ranks = num_ranks(engine)
        self.clock = clock
        self._cv = threading.Condition()
        self._streams: dict[str, RequestStream] = {}  # queued requests: the caller's stream
        # Admitted but not yet in the engine: an abort then has no queue entry to remove and the
        # engine does not know the id yet, so it is noted here and sent once the submit is done.
        self._starting: set[str] = set()
        self._abort_on_start: set[str] = set()
        # Handed to the engine, blocks not allocated there yet (no ADMITTED event): its load does
        # not show them, so every later round's gate counts them (request id -> rank, blocks).
        # Without this a burst passed the gate round after round and queued inside the engine,
        # first come first served, where a warm turn then waited behind cold prompts.
        self._unallocated: dict[str, tuple[int, int]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        engine.add_listener(self._on_lifecycle)

    # ---- Engine protocol ---------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    def start(self) -> None:
        self.engine.start()
        with self._cv:
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._dispatch_loop, name="admission", daemon=True)
                self._thread.start()

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            queued = list(self.policy.queue)
            self.policy.queue.clear()
            self._cv.notify_all()
        for t in queued:
            self._fail(t.request_id, EngineShutdown())
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.engine.shutdown(drain_timeout_s)

    def submit(self, request: EngineRequest) -> RequestStream:
        if self._stopping:
            raise EngineShutdown()
        if not request.prompt_token_ids:
            raise EmptyPrompt()
        request.sampling.validate()
        lookup = self.engine.lookup(request.prompt_token_ids, request.cache_salt, request.block_hashes)
        stream = RequestStream(request.request_id, on_abort=self.abort)
        retry = retry_key(request)  # a digest of the whole prompt: outside the dispatcher's lock
        with self._cv:
            if self._stopping:  # shutdown already failed the queue: nobody would end this stream
                raise EngineShutdown()
            now = self.clock()
            ticket = self.policy.make_ticket(
                request.request_id, lookup, now, request.session_id, request, retry
            )
            self.policy.offer(ticket, now)  # may raise EngineOverloaded: nothing was queued
            self._streams[request.request_id] = stream
            self._cv.notify_all()
        return stream

    def abort(self, request_id: str) -> None:
        with self._cv:
            ticket = self.policy.remove(request_id)
            stream = self._streams.pop(request_id, None) if ticket is not None else None
            if ticket is None and request_id in self._starting:
                self._abort_on_start.add(request_id)
                return
        if ticket is not None:
            if stream is not None:
                stream.put(TokenEvent(request_id, [], finished=True, finish_reason=FinishReason.ABORT))
            return
        self.engine.abort(request_id)

    def lookup(
        self, prompt_token_ids: list[int], cache_salt: str = "", block_hashes: PromptBlockHashes | None = None
    ) -> CacheLookup:
        return self.engine.lookup(prompt_token_ids, cache_salt, block_hashes)

    def load(self) -> EngineLoad:
        load = self.engine.load()
        with self._cv:
            load.waiting += len(self.policy.queue)
        return load

    def add_listener(self, listener: LifecycleListener) -> None:
        self.engine.add_listener(listener)

    def rank_loads(self) -> list[EngineLoad]:
        """Each rank's load (ikcode.engines.placement); an engine without ranks is one."""
        inner = getattr(self.engine, "rank_loads", None)
        return list(inner()) if callable(inner) else [self.engine.load()]

    # ---- admission stats (the gateway's /metrics and request log read these) ------------------
    def stats(self) -> dict[str, Any]:
        with self._cv:
            return self.policy.stats()

    def admission_stats(self) -> dict[str, Any]:
        """Queue wait by class and shedding counts (exported by the gateway's /metrics)."""
        return self.stats()

    def cache_stats(self) -> dict[str, Any]:
        """The wrapped engine's cache counters, so that layers above see through admission."""
        inner = getattr(self.engine, "cache_stats", None)
        if not callable(inner):
            inner = getattr(getattr(self.engine, "cache", None), "snapshot", None)
        return dict(inner()) if callable(inner) else {}

    def ticket_class(self, request_id: str) -> str | None:
        with self._cv:
            t = self.policy.inflight.get(request_id)
        return t.cls.value if t else None

    # ---- internals ---------------------------------------------------------------------------
    def _gate(self) -> RankGate:
        """The gate for one admission round: each ticket's rank and whether its memory takes it."""
        promised: dict[int, int] = {}
        for rank, blocks in self._unallocated.values():
            promised[rank] = promised.get(rank, 0) + blocks
        return RankGate(self.engine, self.policy.config.memory_gate, promised)

    def _allocated(self, request_id: str) -> None:
        """The engine allocated request_id's blocks, or never will (call under the lock)."""
        if self._unallocated.pop(request_id, None) is not None:
            self._cv.notify_all()

    def _dispatch_loop(self) -> None:
        while True:
            with self._cv:
                if self._stopping:
                    return
                handed = self._admit_round()
                if not handed:
                    # Re-check now and then: aging and memory change without a notification.
                    self._cv.wait(timeout=0.05)
                    continue
            for ticket, stream in handed:
                self._start(ticket, stream)

    def _admit_round(self) -> list[tuple[Ticket, RequestStream | None]]:
        """One admission round (under the lock): the tickets admitted, each with its caller's
        stream, counted as starting and as unallocated until the engine says otherwise."""
        gate = self._gate()
        admitted = self.policy.admit(self.clock(), gate)
        for ticket in admitted:
            self._starting.add(ticket.request_id)
            self._unallocated[ticket.request_id] = (ticket.rank, gate.blocks_for(ticket))
        return [(ticket, self._streams.pop(ticket.request_id, None)) for ticket in admitted]

    def _start(self, ticket: Ticket, outer: RequestStream | None) -> None:
        request_id = ticket.request_id
        try:
            if outer is None:
                raise EngineShutdown()  # nobody holds its stream: do not run it
            inner = self.engine.submit(ticket.payload)
        except Exception as exc:  # the dispatcher thread must survive whatever submit raises
            with self._cv:
                self._starting.discard(request_id)
                self._abort_on_start.discard(request_id)
                self._allocated(request_id)
                self.policy.on_done(request_id, self.clock())  # or its cold slot would stay taken
                self._cv.notify_all()
            if outer is not None:
                err = exc if isinstance(exc, EngineError) else EngineError(f"internal engine error: {exc!r}")
                self._put_error(outer, err)
            return
        # The caller's abort now goes to the engine.
        outer._on_abort = self.engine.abort  # noqa: SLF001 - the stream is ours to rewire
        with self._cv:
            self._starting.discard(request_id)
            aborted = request_id in self._abort_on_start
            self._abort_on_start.discard(request_id)
        if aborted:
            self.engine.abort(request_id)
        threading.Thread(target=self._forward, args=(inner, outer), daemon=True).start()

    def _forward(self, inner: RequestStream, outer: RequestStream) -> None:
        for event in inner:
            outer.put(event)
        with self._cv:
            self._allocated(inner.request_id)
            self.policy.on_done(inner.request_id, self.clock())
            self._cv.notify_all()

    def _fail(self, request_id: str, err: EngineError) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._put_error(stream, err)

    @staticmethod
    def _put_error(stream: RequestStream, err: EngineError) -> None:
        stream.put(
            TokenEvent(stream.request_id, [], finished=True, finish_reason=FinishReason.ERROR, error=err)
        )

    def _on_lifecycle(self, event: LifecycleEvent) -> None:
        if event.kind in (LifecycleKind.ADMITTED, LifecycleKind.FINISHED, LifecycleKind.RELEASED):
            with self._cv:
                self._allocated(event.request_id)
        if event.kind is LifecycleKind.FIRST_TOKEN:
            computed = event.stats.computed_tokens if event.stats else None
            with self._cv:
                self.policy.on_first_token(event.request_id, self.clock(), computed)
                self._cv.notify_all()
        elif event.kind in (LifecycleKind.FINISHED, LifecycleKind.RELEASED):
            with self._cv:
                self.policy.on_done(event.request_id, self.clock())
                self._cv.notify_all()


def retry_key(request: EngineRequest) -> str | None:
    """A request without a session id, known again when it is retried: its user's cache salt and
    its whole prompt (a client that retries a 529 sends the same request). None with a session id."""
    if request.session_id:
        return None
    digest = blake2b(request.cache_salt.encode(), digest_size=16)
    digest.update(array("q", request.prompt_token_ids).tobytes())
    return "prompt:" + digest.hexdigest()
