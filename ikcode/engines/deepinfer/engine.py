"""DeepInferEngine: the Engine protocol over DeepInfer's LLMEngine, one engine thread per
data-parallel rank, with ikcode's prefix cache.

The rank threads run in lockstep: every iteration each rank prepares (new work, aborts,
admission, eviction), all meet at a barrier that decides together whether to stop or idle, then
every rank, idle ones included, calls has_unfinished_requests() and step() (or
flush_inflight_reqs()), as DeepInfer's DP ranks must (facts: Several GPUs; entrypoints/llm.py:176-186).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from ikcode.cache import hash_blocks
from ikcode.engines.base import (
    CacheLookup,
    EngineError,
    EngineInfo,
    EngineLoad,
    EngineRequest,
    EngineShutdown,
    LifecycleEvent,
    LifecycleKind,
    LifecycleListener,
    RequestStream,
    check_request,
)
from ikcode.engines.deepinfer.config import KVSTORE_GRAIN, DeepInferConfig
from ikcode.engines.deepinfer.rank import RankWorker
from ikcode.engines.deepinfer.request import RankRequest
from ikcode.engines.deepinfer.routing import SessionRouter

log = logging.getLogger(__name__)


class DeepInferEngine:
    def __init__(self, config: DeepInferConfig, backend: Any = None):
        """backend: the deepinfer names (LLMEngine, EngineArgs, SamplingParams); None imports the
        real package after checking the machine (tests pass the stand-in)."""
        config.validate()
        self.config = config
        if backend is None:
            from ikcode.engines.deepinfer.machine import check_machine, load_backend

            check_machine(config.data_parallel_size)
            backend = load_backend(config.process_environment())
        eos, vocab = config.model_facts()
        self._info = EngineInfo(
            model_name=config.served_model, context_window=config.max_model_len, vocab_size=vocab,
            eos_token_ids=eos, block_size=KVSTORE_GRAIN, kind="deepinfer", device="cuda",
        )  # fmt: skip
        self._listeners: list[LifecycleListener] = []
        dp = config.data_parallel_size
        self.ranks = [RankWorker(r, backend, config, eos, self._emit) for r in range(dp)]
        self.router = SessionRouter(len(self.ranks), config.affinity_max_imbalance)
        self._owner: dict[str, RankWorker] = {}
        self._owner_lock = threading.Lock()
        self._wake = threading.Event()
        self._barrier = threading.Barrier(len(self.ranks), action=self._decide)
        self._decision = (False, False)  # (stop, idle), the same for every rank in an iteration
        self._busy = [False] * len(self.ranks)
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._exit = False
        self.iterations = 0

    # ---- Engine protocol ---------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return self._info

    def start(self) -> None:
        with self._owner_lock:
            if self._threads:
                return
            for worker in self.ranks:
                t = threading.Thread(target=self._run, args=(worker,), name=f"ikcode-deepinfer-{worker.rank}",
                                     daemon=True)  # fmt: skip
                self._threads.append(t)
                t.start()

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        self._stopping = True
        deadline = time.monotonic() + drain_timeout_s
        while time.monotonic() < deadline and any(w.num_active() for w in self.ranks) and self._alive():
            time.sleep(0.01)
        for worker in self.ranks:
            worker.shutdown_requests()
        self._exit = True
        self._wake.set()
        for t in self._threads:
            t.join(timeout=60)

    def submit(self, request: EngineRequest) -> RequestStream:
        if self._stopping:
            raise EngineShutdown()
        prompt = request.prompt_token_ids
        check_request(request, self.config.max_model_len - 1, self._info.vocab_size)
        hashes = hash_blocks(prompt, KVSTORE_GRAIN, request.cache_salt)
        keep = self.config.yoco_keep_tokens

        def cached(rank: int) -> int:
            w = self.ranks[rank]
            with w.lock:
                return w.cache.resumable_blocks(hashes, len(prompt), keep)

        stream = RequestStream(request.request_id, on_abort=self.abort)
        r = RankRequest(request, stream, hashes)
        r.stats.prompt_tokens = len(prompt)
        r.stats.queued_at = time.monotonic()
        with self._owner_lock:
            if request.request_id in self._owner:
                raise EngineError(f"request id {request.request_id!r} is already in use")
            rank = self.router.route(request.session_id, cached, lambda i: self.ranks[i].num_active())
            worker = self.ranks[rank]
            self._owner[request.request_id] = worker
        worker.hand_in(r)
        self.start()
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        with self._owner_lock:
            worker = self._owner.get(request_id)
        if worker is not None:
            worker.request_abort(request_id)
            self._wake.set()

    def lookup(self, prompt_token_ids: list[int], cache_salt: str = "", block_hashes=None) -> CacheLookup:
        """What the best rank holds for this prompt, as it would be resumed (128-aligned, backed
        off by KEEP tokens, at a boundary with a state snapshot)."""
        # block_hashes (the gateway's, at its block size) go unused: the ranks key by their grain.
        hashes = hash_blocks(prompt_token_ids, KVSTORE_GRAIN, cache_salt)
        best = CacheLookup(prompt_tokens=len(prompt_token_ids))
        for w in self.ranks:
            with w.lock:
                n = w.cache.resumable_blocks(hashes, len(prompt_token_ids), self.config.yoco_keep_tokens)
                m = w.cache.cache.match(hashes[:n])
            bs = KVSTORE_GRAIN
            found = CacheLookup(len(prompt_token_ids), m.device_blocks * bs, m.host_blocks * bs)
            if found.cached_tokens > best.cached_tokens:
                best = found
        return best

    def load(self) -> EngineLoad:
        total = EngineLoad()
        for w in self.ranks:
            with w.lock:
                live = list(w.live.values())
                free = w.scheduler.get_num_free_blocks()
                total.running += sum(1 for r in live if r.admitted and not r.closed)
                total.waiting += sum(1 for r in live if not r.admitted)
                total.kv_blocks_total += w.total_blocks
                evictable = len(w.cache.cache.policy)  # pinned by the cache alone: can be unpinned
                total.kv_blocks_used += w.total_blocks - free - evictable
                total.kv_blocks_cached += w.cache.num_pinned
                total.host_blocks_total += w.cache.cache.num_host_blocks
                total.host_blocks_used += len(w.cache.cache.host)
        return total

    def add_listener(self, listener: LifecycleListener) -> None:
        self._listeners.append(listener)

    # ---- truth for /metrics, doctor and tests ---------------------------------------------------
    def cache_stats(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for w in self.ranks:
            with w.lock:
                for key, value in w.cache.cache.snapshot().items():
                    merged[key] = merged.get(key, 0) + value
        return merged

    def idle(self) -> bool:
        return not any(w.num_active() for w in self.ranks)

    def check_invariants(self) -> None:
        """Every rank: cache invariants, pinned == indexed, and, when idle, exactly the pinned
        blocks in use and every state slot free (no leak)."""
        for w in self.ranks:
            with w.lock:
                w.cache.check()
                if not w.live:
                    used = w.total_blocks - w.scheduler.get_num_free_blocks()
                    pinned = w.cache.num_pinned
                    assert used == pinned, f"rank {w.rank}: {used} blocks used, {pinned} pinned"

    # ---- the lockstep loop ----------------------------------------------------------------------
    def _alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def _decide(self) -> None:
        idle = not any(self._busy)
        self._decision = (self._exit and idle, idle)
        self.iterations += 1

    def _run(self, worker: RankWorker) -> None:
        while True:
            try:
                self._busy[worker.rank] = worker.prepare()
            except Exception:
                log.exception("rank %d: prepare failed", worker.rank)
                self._busy[worker.rank] = True
            try:
                self._barrier.wait()
            except threading.BrokenBarrierError:  # another rank's engine failed: so does this one
                worker.fail_everything(EngineError("the engine stopped: another rank failed"))
                return
            stop, idle = self._decision
            if stop:
                return
            if idle:
                self._wake.wait(self.config.idle_wait_s)
                self._wake.clear()
                continue
            try:
                worker.drive(worker.engine.has_unfinished_requests())
            except Exception:
                log.exception("rank %d stopped: the engine failed", worker.rank)
                self._barrier.abort()
                return

    def _emit(self, kind: LifecycleKind, r: RankRequest) -> None:
        if r.internal:
            return
        if kind is LifecycleKind.RELEASED:
            with self._owner_lock:
                self._owner.pop(r.request_id, None)
        event = LifecycleEvent(kind, r.request_id, time.monotonic(), dataclasses.replace(r.stats))
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("lifecycle listener failed")
