"""One DeepInfer data-parallel rank: its LLMEngine, its cache, and its engine thread's step loop.

Every engine call (add_request, try_allocate_seq, abort, step, page copies) happens on the rank's
engine thread: the C++ scheduler releases the GIL while it mutates its queues (facts: Threading).
Callers hand work over through `inbox` / `aborts` under `lock`. The lockstep loop that calls
`prepare` / `drive` on every rank lives in engine.py.

Gaps DeepInfer leaves to the server, filled here (facts: "Gaps the server fills"): EOS is emitted
as a token (stripped), stop ids and max_tokens are enforced here, a prompt add_request refuses
fails at once (no output ever comes for it), aborted RUNNING requests get no final output (the
stream is closed here). The cache is committed in finalize_seq, when the engine really frees the sequence.

Admission of pending requests is in rank_admission.py, closing and releasing them in
rank_release.py; this file holds the state, the hand-over from other threads, and the step with
its outputs.
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

from ikcode.engines.base import (
    EngineError,
    EngineShutdown,
    FinishReason,
    LifecycleKind,
    TokenEvent,
)
from ikcode.engines.deepinfer.caching_engine import make_caching_engine
from ikcode.engines.deepinfer.config import KVSTORE_GRAIN, DeepInferConfig
from ikcode.engines.deepinfer.rank_admission import RankAdmission
from ikcode.engines.deepinfer.rank_cache import RankCache
from ikcode.engines.deepinfer.rank_release import RankRelease
from ikcode.engines.deepinfer.request import RankRequest

log = logging.getLogger(__name__)

Emit = Callable[[LifecycleKind, RankRequest], None]
SNAPSHOTS_PER_REQUEST = 4
_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
PREEMPTED = "insufficient_system_resource"  # FINISHED_PREEMPTED's reason (sequence.hpp:55-56)


def engine_args(config: DeepInferConfig, rank: int) -> dict[str, Any]:
    """EngineArgs of one rank: the profile's [deepinfer] engine_args over ikcode's settings, but
    never without the one this adapter depends on."""
    args: dict[str, Any] = dict(
        model=config.model, max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
        gpu_memory_utilization=config.gpu_memory_utilization, chunked_prefill=config.chunked_prefill,
        max_num_batched_tokens=config.max_num_batched_tokens if config.chunked_prefill else None,
        data_parallel_size=config.data_parallel_size, engine_rank=rank, disable_log_stats=True,
        # The experts split over the ranks (facts: Several GPUs): EngineArgs' default is 1
        # (arg_utils.py:30), which puts every expert on every card.
        expert_parallel_size=config.data_parallel_size,
    )  # fmt: skip
    args.update(config.engine_args)
    # A preempted sequence must end with "insufficient_system_resource" (scheduler.hpp:771-788),
    # as _on_preempted expects; DeepInfer's own LLM sets False (entrypoints/llm.py:68).
    args["stop_preempted_request"] = True
    return args


class RankWorker(RankAdmission, RankRelease):
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
        args = backend.EngineArgs(**engine_args(config, rank))
        self.engine = make_caching_engine(backend.LLMEngine, args)
        self.engine.ikcode_rank = self
        self.scheduler = self.engine.scheduler
        self.blocks = self.engine.block_manager  # llm_engine.py:265
        self.total_blocks = self.blocks.get_num_free_blocks()  # nothing allocated yet
        slots = int(self.total_blocks * config.gpu_tier_fraction)
        self.page_bytes = int(self.engine.driver_worker.cache_engine.gpu_blocks.shape[1])  # one row a page
        by_bytes = config.host_tier_bytes_per_rank // self.page_bytes
        self.host_pages = config.host_tier_blocks_per_rank or by_bytes
        self.cache = RankCache(
            self.engine, slots, self.host_pages, KVSTORE_GRAIN, config.write_through,
            host_pages=host_pages, extra_state_tokens=config.extra_state_tokens,
            max_snapshot_bytes=config.snapshot_bytes_per_rank, policy=config.cache_policy,
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
        self.cache.release_copied()  # the last step's hit copies have run: their sources go free
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

    def shutdown_requests(self) -> None:
        self.abort_all_error = EngineShutdown()
