"""DeepInferEngine: the Engine protocol over DeepInfer, one OS process per data-parallel rank
(rank_process.py), with ikcode's prefix cache in each rank.

The gateway process spawns the ranks (multiprocessing, spawn; MASTER_ADDR / MASTER_PORT and one
visible GPU each), routes each request to a rank (session affinity, then the rank holding the
longest prefix), and turns the ranks' messages into RequestStreams and lifecycle events. A rank
that dies is detected by its pipe closing, one that hangs by its silence (watchdog.py): its
requests fail at once, the other ranks (which would wait for it in their next collective) are
stopped, and the engine refuses new work with the reason. Shutdown drains, tells the ranks to
stop together, and joins them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ikcode.cache import hash_blocks
from ikcode.cache.stats import merge_stats
from ikcode.engines.base import (
    CacheLookup,
    EngineError,
    EngineInfo,
    EngineLoad,
    EngineRequest,
    EngineShutdown,
    FinishReason,
    LifecycleEvent,
    LifecycleListener,
    RequestStream,
    TokenEvent,
    check_request,
)
from ikcode.engines.deepinfer.config import KVSTORE_GRAIN, DeepInferConfig
from ikcode.engines.deepinfer.host_pool import HostPool, HostPoolTooLarge
from ikcode.engines.deepinfer.rank_process import RankSpec, rank_main
from ikcode.engines.deepinfer.routing import SessionRouter
from ikcode.engines.deepinfer.watchdog import RankWatchdog
from ikcode.engines.placement import Placement

log = logging.getLogger(__name__)
RPC_TIMEOUT_S = 60.0


class _Rank:
    def __init__(self, rank: int, process: Any, conn: Any):
        self.rank, self.process, self.conn = rank, process, conn
        self.send_lock = threading.Lock()
        self.ready = threading.Event()
        self.info: dict[str, Any] = {}
        self.load = EngineLoad()
        self.requests: set[str] = set()
        # Submitted, no token yet: the rank's queue (routing), with the blocks each computes there.
        self.prefilling: dict[str, int] = {}
        self.reader: threading.Thread | None = None
        self.heard_at: float | None = None  # its last message, from its first beat on (watchdog.py)

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)


class DeepInferEngine:
    def __init__(self, config: DeepInferConfig):
        config.validate()
        self.config = config
        eos, vocab = config.model_facts()
        self._eos = eos
        self._info = EngineInfo(
            model_name=config.served_model, context_window=config.max_model_len, vocab_size=vocab,
            eos_token_ids=eos, block_size=KVSTORE_GRAIN, kind="deepinfer", device="cuda",
        )  # fmt: skip
        self._listeners: list[LifecycleListener] = []
        self.router = SessionRouter(config.data_parallel_size, config.affinity_max_imbalance)
        self._lock = threading.Lock()
        # One thread at a time reaps the rank processes: two threads waiting on the same child race
        # in waitpid, and the loser sees a dead rank as still alive.
        self._reap_lock = threading.Lock()
        self._streams: dict[str, tuple[RequestStream, _Rank]] = {}
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self.ranks: list[_Rank] = []
        self.host_pool: HostPool | None = None
        self._stopping = False
        self.failure: str | None = None  # why the engine stopped serving (a rank died)
        self._started = False
        # Lifecycle events reach the listeners on their own thread, in order: a listener may
        # wait for a lock whose holder waits for a rank's reply (admission asks placement()
        # under its lock), and replies arrive on the reader threads.
        self._life: queue.Queue = queue.Queue()
        self._life_thread: threading.Thread | None = None

    # ---- Engine protocol ---------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return self._info

    def start(self) -> None:
        """Spawn the ranks and wait until every one has built its engine (or one failed)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        self._life_thread = threading.Thread(
            target=self._deliver_life, name="ikcode-deepinfer-life", daemon=True
        )
        self._life_thread.start()
        ctx = multiprocessing.get_context("spawn")
        for rank in range(self.config.data_parallel_size):
            parent, child = ctx.Pipe()
            spec = RankSpec(rank, self.config, self._eos)
            process = ctx.Process(
                target=rank_main, args=(spec, child), name=f"ikcode-deepinfer-rank{rank}", daemon=True
            )
            process.start()
            child.close()
            r = _Rank(rank, process, parent)
            r.reader = threading.Thread(
                target=self._read, args=(r,), name=f"ikcode-deepinfer-read{rank}", daemon=True
            )
            self.ranks.append(r)
            r.reader.start()
        deadline = time.monotonic() + self.config.rank_start_timeout_s
        for r in self.ranks:
            while not r.ready.wait(0.1):
                if self.failure or time.monotonic() > deadline:
                    reason = (
                        self.failure
                        or f"rank {r.rank} did not start in {self.config.rank_start_timeout_s:.0f} s"
                    )
                    self._stop_processes()
                    raise EngineError(f"deepinfer failed to start: {reason}")
        # Each rank sized its host tier from its own page size: one pool of equal slices.
        sizes = {(int(r.info["host_pages"]), int(r.info["page_bytes"])) for r in self.ranks}
        if len(sizes) > 1:
            self._stop_processes()
            raise EngineError(f"deepinfer ranks disagree on their host tier (pages, bytes): {sorted(sizes)}")
        pages = int(self.ranks[0].info["host_pages"])
        if pages:
            page_bytes = int(self.ranks[0].info["page_bytes"])
            try:
                self.host_pool = HostPool(pages * len(self.ranks), page_bytes)
            except HostPoolTooLarge as err:
                self._stop_processes()
                raise EngineError(f"deepinfer failed to start: {err}") from None
            for r in self.ranks:
                r.send(("host_pool", self.host_pool.name, r.rank * pages, pages, page_bytes))
        stopped = lambda: self._stopping or self.failure is not None  # noqa: E731
        RankWatchdog(self.config.hung_rank_s, self.ranks, self._rank_died, stopped).start()

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        self._stopping = True
        if not self._started:
            return
        deadline = time.monotonic() + drain_timeout_s
        while time.monotonic() < deadline and self._streams and not self.failure:
            time.sleep(0.01)
        for r in self.ranks:
            with contextlib.suppress(OSError):  # a rank that is gone
                r.send(("stop",))
        with self._reap_lock:
            for r in self.ranks:
                r.process.join(timeout=max(5.0, deadline - time.monotonic() + 5.0))
            self._stop_processes_locked()
        self._fail_streams(EngineShutdown())
        if self.host_pool is not None:
            self.host_pool.close()

    def submit(self, request: EngineRequest) -> RequestStream:
        if self._stopping:
            raise EngineShutdown()
        if self.failure:
            raise EngineError(f"the deepinfer engine stopped: {self.failure}")
        check_request(request, self.config.max_model_len - 1, self._info.vocab_size)
        self.start()
        prompt = request.prompt_token_ids
        hashes = hash_blocks(prompt, KVSTORE_GRAIN, request.cache_salt)
        cached = [self._call(r, "resumable", hashes, len(prompt)) for r in self.ranks]
        blocks = -(-len(prompt) // KVSTORE_GRAIN)
        stream = RequestStream(request.request_id, on_abort=self.abort)
        with self._lock:
            if request.request_id in self._streams:
                raise EngineError(f"request id {request.request_id!r} is already in use")
            index = self.router.route(
                request.session_id, lambda i: cached[i], self._queued, self._work(blocks, cached)
            )
            rank = self.ranks[index]
            self._streams[request.request_id] = (stream, rank)
            rank.requests.add(request.request_id)
            rank.prefilling[request.request_id] = blocks - cached[index]
        rank.send(("submit", request, hashes))
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
        if entry is not None:
            with contextlib.suppress(OSError):  # its rank is gone: the request failed with it
                entry[1].send(("abort", request_id))

    def lookup(self, prompt_token_ids: list[int], cache_salt: str = "", block_hashes=None) -> CacheLookup:
        """What the best rank holds for this prompt, as it would be resumed."""
        # block_hashes (the gateway's, at its block size) go unused: the ranks key by their grain.
        best = CacheLookup(prompt_tokens=len(prompt_token_ids))
        if not self.ranks or self.failure:
            return best
        hashes = hash_blocks(prompt_token_ids, KVSTORE_GRAIN, cache_salt)
        for r in self.ranks:
            found = self._call(r, "lookup", hashes, len(prompt_token_ids))
            if found.cached_tokens > best.cached_tokens:
                best = found
        return best

    def load(self) -> EngineLoad:
        total = EngineLoad()
        for r in self.ranks:
            for field in vars(total):
                setattr(total, field, getattr(total, field) + getattr(r.load, field))
        return total

    def add_listener(self, listener: LifecycleListener) -> None:
        self._listeners.append(listener)

    # ---- placement (ikcode.engines.placement) ---------------------------------------------------
    def rank_loads(self) -> list[EngineLoad]:
        """Each rank's load as it last reported it (pushed after every step that changed it, so
        no round trip here). The reserve kept free for the prefill watermark is never given to a
        sequence (RankWorker._admit_pending), so it is not counted as the rank's to give."""
        if not self.ranks:  # not started: the ranks exist, nothing is known of them yet
            return [EngineLoad() for _ in range(self.config.data_parallel_size)]
        return [
            dataclasses.replace(
                r.load, kv_blocks_total=max(0, r.info["total_blocks"] - r.info["reserve_blocks"])
            )
            for r in self.ranks
        ]

    def placement(self, request: EngineRequest, admitting: list[int]) -> Placement:
        """The rank submit() would route request to with admitting[r] more requests on rank r,
        and the blocks its allocation takes there: the whole prompt. A device hit is copied into
        the sequence's own blocks, and the cached blocks it was copied from go back free as its
        slots are pointed at the copy (RankCache.admit), so a hit takes nothing more from the free
        or evictable pool. Leaves the router as it is: one cheap call per rank."""
        self.start()
        prompt = request.prompt_token_ids
        if self.failure or self._stopping:  # submit() will say why; admission must not raise here
            return Placement(0, -(-len(prompt) // KVSTORE_GRAIN))
        hashes = hash_blocks(prompt, KVSTORE_GRAIN, request.cache_salt)
        probes = [self._call(r, "resumable", hashes, len(prompt)) for r in self.ranks]
        extra = list(admitting) + [0] * (len(self.ranks) - len(admitting))
        blocks = -(-len(prompt) // KVSTORE_GRAIN)
        index = self.router.peek(
            request.session_id,
            lambda i: probes[i],
            lambda i: self._queued(i) + extra[i],
            self._work(blocks, probes),
        )
        return Placement(index, blocks)

    # ---- truth for /metrics, doctor and tests ---------------------------------------------------
    def cache_stats(self) -> dict[str, float]:
        parts = []
        for r in self.ranks:
            if self.failure:
                break
            parts.append(self._call(r, "cache_stats"))
        return merge_stats(parts)

    def check(self) -> list[dict[str, Any]]:
        """Each rank's invariants (raises if broken) and its block / state-slot counts."""
        return [self._call(r, "check") for r in self.ranks]

    def idle(self) -> bool:
        return not self._streams

    # ---- messages from the ranks ----------------------------------------------------------------
    def _queued(self, index: int) -> int:
        """Requests on the rank still waiting for their prefill (the router's load)."""
        return len(self.ranks[index].prefilling)

    def _work(self, blocks: int, cached: list[int]) -> Callable[[int], int]:
        """work(rank) for the router: the prefill queued on the rank (blocks each request there
        computes) plus this prompt's blocks not cached there."""
        # copy(): placement() reads this outside the lock while events pop entries
        return lambda i: sum(self.ranks[i].prefilling.copy().values()) + blocks - cached[i]

    def _call(self, r: _Rank, name: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        future: Future = Future()
        self._calls[call_id] = future
        try:
            r.send(("call", call_id, name, args))
            return future.result(timeout=RPC_TIMEOUT_S)
        except OSError as err:
            raise EngineError(f"deepinfer rank {r.rank} is gone: {err}") from None
        except TimeoutError:  # concurrent.futures' (an alias of the built-in since 3.11)
            waited = f"{RPC_TIMEOUT_S:.0f} s"
            raise EngineError(f"deepinfer rank {r.rank} did not answer {name!r} in {waited}") from None
        finally:
            self._calls.pop(call_id, None)

    def _read(self, r: _Rank) -> None:
        while True:
            try:
                message = r.conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            r.heard_at = time.monotonic() if kind == "alive" or r.heard_at is not None else None
            if kind == "event":
                self._on_event(message[1])
            elif kind == "life":
                self._life.put((message[1], message[2], message[3], time.monotonic()))
            elif kind == "reply":
                future = self._calls.get(message[1])
                if future is not None:
                    ok, value = message[2], message[3]
                    future.set_result(value) if ok else future.set_exception(EngineError(value))
            elif kind == "load":
                r.load = message[2]
            elif kind == "ready":
                r.info = message[1]
                r.ready.set()
            elif kind == "fatal":
                log.error("%s\n%s", message[1], message[2])
                # Ranks meet in every step: a rank that was killed shows up first as a gloo
                # error in its peers. Report the rank that is gone, the cause, not the symptom.
                gone = next((o for o in self.ranks if o is not r and not o.process.is_alive()), None)
                if gone is not None:
                    self._rank_died(gone, f"rank {gone.rank} exited (exit code {gone.process.exitcode})")
                else:
                    self._rank_died(r, message[1])
        if not self._stopping or self._streams:
            r.process.join(timeout=5)
            self._rank_died(r, f"rank {r.rank} exited (exit code {r.process.exitcode})")

    def _on_event(self, event: TokenEvent) -> None:
        with self._lock:
            entry = self._streams.get(event.request_id)
            if entry is not None:
                entry[1].prefilling.pop(event.request_id, None)  # its first token, or its end
            if entry is not None and event.finished:
                del self._streams[event.request_id]
                entry[1].requests.discard(event.request_id)
        if entry is not None:
            entry[0].put(event)

    def _deliver_life(self) -> None:
        while True:
            kind, request_id, stats, at = self._life.get()
            event = LifecycleEvent(kind, request_id, at, stats)
            for listener in self._listeners:
                try:
                    listener(event)
                except Exception:
                    log.exception("lifecycle listener failed")

    def _rank_died(self, r: _Rank, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        log.error("deepinfer: %s; stopping the other ranks", reason)
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(EngineError(f"the deepinfer engine stopped: {reason}"))
        self._fail_streams(EngineError(f"the deepinfer engine stopped: {reason}"))
        threading.Thread(target=self._stop_processes, daemon=True).start()

    def _fail_streams(self, error: EngineError) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream, rank in streams:
            rank.requests.discard(stream.request_id)
            rank.prefilling.pop(stream.request_id, None)
            stream.put(TokenEvent(stream.request_id, [], True, FinishReason.ERROR, None, error))

    def _stop_processes(self) -> None:
        with self._reap_lock:
            self._stop_processes_locked()

    def _stop_processes_locked(self) -> None:
        for r in self.ranks:
            if r.process.is_alive():
                r.process.terminate()
        for r in self.ranks:
            r.process.join(timeout=10)
            if r.process.is_alive():
                # A rank blocked in a collective with a dead peer may not act on SIGTERM in time.
                r.process.kill()
                r.process.join(timeout=10)  # reap it, so nothing is left running after shutdown
