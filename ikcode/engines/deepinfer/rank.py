"""One DeepInfer data-parallel rank: its LLMEngine, its cache, and the work its engine thread does.

Every engine call (add_request, try_allocate_seq, abort, step, page copies) happens on the rank's
engine thread: the C++ scheduler releases the GIL while it mutates its queues (facts: Threading).
Callers hand work over through `inbox` / `aborts` under `lock`. The lockstep loop that calls
`prepare` / `drive` on every rank lives in engine.py.

Gaps DeepInfer leaves to the server, filled here (facts: "Gaps the server fills"): EOS is emitted
as a token (stripped), stop ids and max_tokens are enforced here, rejected requests echo the
prompt's last token (never streamed), aborted RUNNING requests get no final output (the stream is
closed here). The cache is committed in finalize_seq, when the engine really frees the sequence.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ikcode.cache import hash_blocks
from ikcode.engines.base import (
    EngineError,
    EngineOverloaded,
    EngineShutdown,
    FinishReason,
    LifecycleKind,
    PromptTooLong,
    RequestStream,
    TokenEvent,
)
from ikcode.engines.deepinfer.caching_engine import make_caching_engine
from ikcode.engines.deepinfer.config import KVSTORE_GRAIN, DeepInferConfig
from ikcode.engines.deepinfer.rank_cache import RankCache
from ikcode.engines.deepinfer.request import RankRequest

log = logging.getLogger(__name__)

Emit = Callable[[LifecycleKind, RankRequest], None]
SNAPSHOTS_PER_REQUEST = 4
_QUERY_STATS = (
    "requests", "query_tokens", "query_blocks", "hit_tokens_device", "hit_tokens_host",
    "hit_blocks_device", "hit_blocks_host",
)  # fmt: skip
_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
PREEMPTED = "insufficient_system_resource"  # FINISHED_PREEMPTED's reason (sequence.hpp:55-56)
NO_BINDING = (
    "this deepinfer build does not expose Sequence.block_table: apply ikcode's patch "
    "(ikcode/engines/deepinfer/patches/README.md) and rebuild"
)


class RankWorker:
    def __init__(
        self,
        rank: int,
        backend: Any,
        config: DeepInferConfig,
        eos_ids: tuple[int, ...],
        emit: Emit,
        host_pages: Any = None,
    ):
        self.rank = rank
        self.backend = backend
        self.config = config
        self.eos_ids = frozenset(eos_ids)
        self.emit = emit
        args = backend.EngineArgs(
            model=config.model, max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
            gpu_memory_utilization=config.gpu_memory_utilization, chunked_prefill=config.chunked_prefill,
            max_num_batched_tokens=config.max_num_batched_tokens if config.chunked_prefill else None,
            data_parallel_size=config.data_parallel_size, engine_rank=rank, disable_log_stats=True,
            **config.engine_args,
        )  # fmt: skip
        self.engine = make_caching_engine(backend.LLMEngine, args)
        self.engine.ikcode_rank = self
        self.scheduler = self.engine.scheduler
        self.blocks = self.engine.block_manager  # llm_engine.py:265
        self.total_blocks = self.blocks.get_num_free_blocks()  # nothing allocated yet
        slots = int(self.total_blocks * config.gpu_tier_fraction)
        self.cache = RankCache(
            self.engine, slots, config.host_tier_blocks_per_rank, KVSTORE_GRAIN, config.write_through,
            host_pages=host_pages, extra_state_tokens=config.extra_state_tokens,
        )  # fmt: skip
        self.commit_failures = 0  # finalize_seq commits that raised (surfaced by cache_stats and doctor)
        self.preempted = 0  # sequences DeepInfer stopped for lack of KV memory (scheduler.hpp:766-790)
        self.stall_guard_hits = 0  # allocations handed back to keep free blocks above the reserve
        # Free blocks that keep block usage under the prefill watermark (scheduler.hpp:80, 313).
        self.reserve_blocks = int(np.ceil((1.0 - config.prefill_watermark) * self.total_blocks)) + 1
        self.lock = threading.Lock()  # inbox, aborts, live, and cache reads from other threads
        self.inbox: deque[RankRequest] = deque()
        self.aborts: list[str] = []
        self.pending: deque[RankRequest] = deque()  # not yet allocated in the engine
        self.live: dict[str, RankRequest] = {}  # submitted and not yet released
        self.abort_all_error: EngineError | None = None

    # ---- called from other threads --------------------------------------------------------------
    def hand_in(self, r: RankRequest) -> None:
        with self.lock:
            self.live[r.request_id] = r
            self.inbox.append(r)

    def request_abort(self, request_id: str) -> None:
        with self.lock:
            self.aborts.append(request_id)

    def num_active(self) -> int:
        with self.lock:
            return len(self.live)

    # ---- engine thread: before the step ---------------------------------------------------------
    def prepare(self) -> bool:
        """Take new work and aborts, admit what fits, evict for the watermark. True if busy."""
        with self.lock:
            new, self.inbox = list(self.inbox), deque()
            aborts, self.aborts = self.aborts, []
        self.pending.extend(new)
        for request_id in aborts:
            self._abort(request_id, None)
        if self.abort_all_error is not None:
            for request_id in list(self.live):
                self._abort(request_id, self.abort_all_error)
        self._admit_pending()
        if self.live:
            with self.lock:
                self.cache.evict_for(self.reserve_blocks)
        with self.lock:
            return bool(self.live)

    def _admit_pending(self) -> None:
        for r in list(self.pending):
            if r.prime is not None and r.prime.stats.released_at is None:
                continue  # its priming pass runs first
            if r.seq is None and not r.internal and r.cached_before_prime is None and self._start_prime(r):
                continue
            try:
                added = r.seq is not None or self._add(r)
            except Exception as exc:
                self.pending.remove(r)
                if r.seq is not None:
                    self.engine.abort_request(r.request_id)
                self._fail(r, exc)
                continue
            if not added:
                self.pending.remove(r)
                continue
            blocks = -(-len(r.request.prompt_token_ids) // KVSTORE_GRAIN)
            with self.lock:
                self.cache.evict_for(blocks + self.reserve_blocks)
            allocated = self.scheduler.try_allocate_seq(r.seq)
            if allocated and self.blocks.get_num_free_blocks() < self.reserve_blocks:
                # Prefill-stall guard: past the watermark DeepInfer admits no prefill
                # (scheduler.hpp:80, 313) and has no eviction of its own; admitting this one now
                # could leave every sequence waiting. Give the blocks back and retry later.
                self.scheduler.free_seq(r.seq)
                allocated = False
                self.stall_guard_hits += 1
            if not allocated:
                if any(x.admitted for x in self.live.values()):
                    return  # back-pressure: memory comes back as running requests finish
                self.pending.remove(r)
                free = self.blocks.get_num_free_blocks()
                self._fail(r, EngineOverloaded(f"rank {self.rank}: needs {blocks} KV blocks, {free} free"))
                continue
            self.pending.remove(r)
            try:
                self._resume(r)
            except Exception as exc:
                log.exception("admission of %s failed", r.request_id)
                self.scheduler.free_seq(r.seq)  # allocated by try_allocate_seq, never added
                with self.lock:
                    self.cache.drop(r.request_id)
                self._fail(r, exc)

    def _start_prime(self, r: RankRequest) -> bool:
        """Queue a priming pass over prompt[:P + 1] ahead of r when it pays (config.prime_min_tokens)."""
        prompt = r.request.prompt_token_ids
        keep, bs = self.config.yoco_keep_tokens, KVSTORE_GRAIN
        target = max(0, len(prompt) - keep) // bs * bs
        with self.lock:
            n = self.cache.resumable_blocks(r.hashes, len(prompt), keep)
            m = self.cache.cache.match(r.hashes[:n])
        r.cached_before_prime = (m.device_blocks * bs, m.host_blocks * bs)
        if not self.config.prime_min_tokens or target - n * bs < self.config.prime_min_tokens:
            return False
        sampling = dataclasses.replace(r.request.sampling, max_tokens=1, stop_token_ids=(), temperature=0.0)
        request = dataclasses.replace(
            r.request, request_id=f"{r.request_id}#prime", prompt_token_ids=list(prompt[: target + 1]),
            sampling=sampling,
        )  # fmt: skip
        stream = RequestStream(request.request_id)  # nobody reads it
        prime = RankRequest(request, stream, r.hashes[: target // bs], internal=True)
        r.prime = prime
        with self.lock:
            self.live[request.request_id] = prime
        self.pending.insert(self.pending.index(r), prime)
        return True

    def _add(self, r: RankRequest) -> bool:
        s = r.request.sampling
        params = self.backend.SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1,
            max_tokens=s.max_tokens, seq_seed=s.seed if s.seed is not None else self.config.seed,
        )  # fmt: skip
        prompt = np.asarray(r.request.prompt_token_ids, dtype=np.int32)
        user = r.request.cache_salt or "ikcode"
        r.seq = self.engine.add_request(user, r.request_id, params, prompt, enqueue=False)
        if r.seq is None:
            r.rejected = True  # the next step's output echoes the prompt's last token and says why
            return False
        if not hasattr(r.seq, "block_table"):
            raise RuntimeError(NO_BINDING)
        return True

    def _resume(self, r: RankRequest) -> None:
        """The cache hit (if any) into the allocated sequence, then hand it to the scheduler."""
        prompt_len = len(r.request.prompt_token_ids)
        with self.lock:
            n = self.cache.resumable_blocks(r.hashes, prompt_len, self.config.yoco_keep_tokens)
            counted = dataclasses.replace(self.cache.cache.stats)
            device, host = self.cache.admit(r.seq, r.request_id, r.hashes, n, r.request.session_id)
            if r.internal:  # a priming pass is not a request of anyone's
                for name in _QUERY_STATS:
                    setattr(self.cache.cache.stats, name, getattr(counted, name))
        self.scheduler.add_sequence(r.seq)
        r.admitted = True
        if r.prime is not None and r.cached_before_prime is not None:
            # What the priming pass computed a moment ago was computed for r: not a cache hit.
            before = r.cached_before_prime
            with self.lock:
                stats = self.cache.cache.stats
                extra = device - before[0]
                stats.hit_tokens_device -= extra
                stats.hit_blocks_device -= extra // KVSTORE_GRAIN
            device, host = min(device, before[0]), min(host, before[1])
        r.stats.cached_tokens_device, r.stats.cached_tokens_host = device, host
        r.stats.computed_tokens = prompt_len - device - host
        r.stats.admitted_at = time.monotonic()
        self.emit(LifecycleKind.ADMITTED, r)

    # ---- engine thread: the step and its outputs ------------------------------------------------
    def drive(self, any_unfinished: bool) -> None:
        """One lockstep iteration (entrypoints/llm.py:176-186); outputs copied at once, since the
        next step() releases them (pybind_output.cpp:12-35)."""
        out = self.backend.RequestOutput  # static getters over output pointers (pybind_output.cpp:12-34)
        try:
            outs = self.engine.step() if any_unfinished else self.engine.flush_inflight_reqs()
            copied = [
                (
                    out.get_request_id(p),
                    out.get_token_id(p),
                    out.get_finish_reason(p),
                    bool(out.get_finished(p)),
                )
                for p in (int(x) for x in outs)
            ]
        except Exception as exc:
            log.exception("rank %d: engine step failed", self.rank)
            self.fail_everything(exc)
            raise
        for request_id, token, reason, finished in copied:
            r = self.live.get(request_id)
            if r is not None:
                self._on_output(r, int(token), reason, finished)
        self._snapshot_progress()

    def _snapshot_progress(self) -> None:
        """Keep the window at each sequence's latest 128 boundary (DEEPINFER_PREFILL_STORE_EXTRA_STATE
        keeps only the last one in the ring): the resume points of the next turn."""
        for r in self.live.values():
            if not r.admitted or r.closed or r.failed:
                continue
            boundary = int(r.seq.num_cached_tokens) // KVSTORE_GRAIN * KVSTORE_GRAIN
            if boundary <= max(r.snapshots, default=0):
                continue
            try:
                snapshot = self.cache.select_state(r.seq, boundary)
            except Exception:  # a resume point fewer, not a reason to stop the rank
                log.exception("rank %d: reading the window of %s failed", self.rank, r.request_id)
                continue
            if snapshot is None:
                continue
            r.snapshots[boundary] = snapshot
            while len(r.snapshots) > SNAPSHOTS_PER_REQUEST:
                del r.snapshots[min(r.snapshots)]

    def _on_output(self, r: RankRequest, token: int, reason: str | None, finished: bool) -> None:
        if reason == PREEMPTED and r.admitted:
            self._on_preempted(r)
            return
        if r.rejected:  # the echoed prompt token is not an answer
            n = len(r.request.prompt_token_ids)
            err: EngineError = (
                PromptTooLong(n, self.config.max_model_len - 1)
                if reason == "prompt_length_exceeded"
                else EngineOverloaded(f"deepinfer rejected the request: {reason}")
            )
            self._fail(r, err)
            return
        r.engine_tokens.append(token)
        r.engine_finished = r.engine_finished or finished
        if r.closed:
            return
        s = r.request.sampling
        first = r.stats.first_token_at is None
        if first:
            r.stats.first_token_at = time.monotonic()
            self.emit(LifecycleKind.FIRST_TOKEN, r)
        if (token in self.eos_ids and not s.ignore_eos) or token in s.stop_token_ids:
            self._close(r, FinishReason.STOP, [])  # EOS / stop id: stripped from the stream
            return
        r.num_streamed += 1
        r.stats.output_tokens = r.num_streamed
        if r.num_streamed >= s.max_tokens:
            self._close(r, FinishReason.LENGTH, [token])
        elif finished:
            self._close(r, _REASONS.get(reason or "", FinishReason.STOP), [token])
        else:
            stats = dataclasses.replace(r.stats) if first else None
            r.stream.put(TokenEvent(r.request_id, [token], stats=stats))

    def _close(
        self, r: RankRequest, reason: FinishReason, tokens: list[int], error: EngineError | None = None
    ) -> None:
        """The stream's final event. The engine may hold the sequence for steps more: the cache
        entry waits for finalize_seq, unless this is the final-token variant (the published bug)."""
        r.closed = True
        r.stats.finished_at = time.monotonic()
        self.emit(LifecycleKind.FINISHED, r)
        event = TokenEvent(r.request_id, tokens, True, reason, dataclasses.replace(r.stats), error)
        r.stream.put(event)
        if self.config.commit_point == "final_token" and r.admitted:
            with self.lock:
                self.cache.drop(r.request_id)  # finalised now: nothing is left to commit at release
        if r.admitted and not r.engine_finished and not r.failed:
            self.engine.abort_request(r.request_id)  # stop id or max_tokens: the engine stops too

    def _on_preempted(self, r: RankRequest) -> None:
        """DeepInfer stopped the sequence for lack of KV memory: it freed blocks and state itself,
        without finalize_seq, and echoed the last token (scheduler.hpp:766-790, outputs.hpp:297-304).
        The echo is not streamed, nothing is committed (the KV is gone), the request is released."""
        self.preempted += 1
        r.failed = True
        if not r.closed:
            self._close(r, FinishReason.ERROR, [], EngineOverloaded(f"rank {self.rank}: out of KV memory"))
        with self.lock:
            self.cache.drop(r.request_id)
        self._release(r)

    # ---- release: finalize_seq ------------------------------------------------------------------
    def on_finalize(self, seq: Any) -> None:
        """Inside finalize_seq, before the parent frees blocks and state: commit the valid blocks
        (seq.num_cached_tokens of them are valid at close: len - 1 for a finished sequence)."""
        r = self.live.get(seq.request_id)
        if r is None:
            return
        if not r.closed:  # an aborted RUNNING sequence emits no final output
            self._close(r, FinishReason.ABORT, [])
        try:
            with self.lock:
                if r.failed:
                    self.cache.drop(r.request_id)
                elif r.request_id in self.cache.cache._seqs:  # noqa: SLF001 - dropped by the final-token variant
                    valid = min(int(seq.num_cached_tokens), len(r.engine_tokens))
                    full = valid // KVSTORE_GRAIN * KVSTORE_GRAIN
                    keys = hash_blocks(r.engine_tokens[:full], KVSTORE_GRAIN, r.request.cache_salt)
                    self.cache.commit(seq, r.request_id, keys, r.snapshots)
        except BaseException:
            with self.lock:
                self.cache.drop(r.request_id)  # nothing half-committed stays behind
            raise
        finally:
            self._release(r)

    def _release(self, r: RankRequest) -> None:
        if r.stats.released_at is not None:
            return
        r.stats.released_at = time.monotonic()
        with self.lock:
            self.live.pop(r.request_id, None)
        self.emit(LifecycleKind.RELEASED, r)

    # ---- aborts and failures --------------------------------------------------------------------
    def _abort(self, request_id: str, error: EngineError | None) -> None:
        r = self.live.get(request_id)
        if r is None or r.closed:
            return
        if not r.admitted:  # still ours: nothing allocated in the engine
            if r in self.pending:
                self.pending.remove(r)
            if r.seq is not None:
                self.engine.abort_request(request_id)
            self._close(r, FinishReason.ABORT, [], error)
            self._release(r)
        elif _is_waiting(r.seq):
            # An aborted WAITING sequence never reaches finalize_seq: free what it holds ourselves.
            self._close(r, FinishReason.ABORT, [], error)  # aborts it in the engine
            self.scheduler.free_seq(r.seq)
            with self.lock:
                self.cache.drop(request_id)
            self._release(r)
        else:
            self._close(r, FinishReason.ABORT, [], error)  # no final output will come

    def _fail(self, r: RankRequest, exc: BaseException) -> None:
        r.failed = True
        if not r.closed:
            err = exc if isinstance(exc, EngineError) else EngineError(f"internal engine error: {exc!r}")
            self._close(r, FinishReason.ERROR, [], err)
        if not r.admitted:
            self._release(r)

    def fail_everything(self, exc: BaseException) -> None:
        for r in list(self.live.values()):
            self._fail(r, exc)
            if r.admitted:
                try:
                    self.engine.abort_request(r.request_id)
                    self.scheduler.free_seq(r.seq)
                except Exception:
                    log.exception("could not free %s", r.request_id)
                with self.lock:
                    self.cache.drop(r.request_id)
                self._release(r)
        self.pending.clear()

    def shutdown_requests(self) -> None:
        self.abort_all_error = EngineShutdown()


def _is_waiting(seq: Any) -> bool:
    """Still queued in the engine (not yet scheduled). Read from the bound status enum."""
    status = getattr(seq, "status", None)
    return str(getattr(status, "name", status)).upper().endswith("WAITING")
