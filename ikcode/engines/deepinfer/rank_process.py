"""One DeepInfer data-parallel rank in its own OS process, as DeepInfer expects: each engine joins
the ranks with one gloo init_process_group per process (worker/base.py:320-345;
parallel_state.py:190 is a process-wide singleton) and uses cuda:0 of its own process.

The process runs the lockstep loop of every DP rank (entrypoints/llm.py:176-186): take the
gateway's messages, prepare (admission, aborts, eviction), agree with the other ranks whether to
stop (one all_reduce on DeepInfer's CPU data-parallel group), then has_unfinished_requests()
(DeepInfer's own all_reduce) and step() or flush_inflight_reqs(). Idle ranks step too: the
scheduler runs placeholder steps for them. It talks to the gateway over a multiprocessing pipe.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import time
import traceback
from typing import Any

from ikcode.engines.base import CacheLookup, EngineLoad, EngineRequest, LifecycleKind, TokenEvent
from ikcode.engines.deepinfer.config import KVSTORE_GRAIN, DeepInferConfig
from ikcode.engines.deepinfer.watchdog import beat_interval_s

log = logging.getLogger(__name__)


class RemoteStream:
    """The rank side of a request's stream: every event goes to the gateway process."""

    def __init__(self, request_id: str, send: Any):
        self.request_id = request_id
        self._send = send
        self.closed = False

    def put(self, event: TokenEvent) -> None:
        if self.closed:
            return
        self.closed = event.finished
        self._send(("event", event))


def load_backend(spec: str) -> Any:
    """The deepinfer names the adapter uses: from the installed package, or from `module:function`."""
    if spec == "deepinfer":
        from ikcode.engines.deepinfer.machine import load_backend as load_installed

        return load_installed()
    module, _, func = spec.partition(":")
    return getattr(importlib.import_module(module), func)()


@dataclasses.dataclass
class RankSpec:
    rank: int
    config: DeepInferConfig
    eos_ids: tuple[int, ...]


def rank_main(spec: RankSpec, conn: Any) -> None:
    """Entry point of a rank process (multiprocessing, spawn)."""
    os.environ.update(spec.config.process_environment(spec.rank))
    logging.basicConfig(
        level=logging.WARNING, format=f"[rank {spec.rank}] %(levelname)s %(name)s: %(message)s"
    )
    try:
        loop = RankLoop(spec, conn)
    except BaseException as exc:
        conn.send(
            (
                "fatal",
                f"rank {spec.rank} failed to start: {type(exc).__name__}: {exc}",
                traceback.format_exc(),
            )
        )
        raise SystemExit(1) from None
    conn.send(
        (
            "ready",
            {
                "rank": spec.rank,
                "total_blocks": loop.worker.total_blocks,
                "reserve_blocks": loop.worker.reserve_blocks,
                "page_bytes": loop.worker.page_bytes,
                "host_pages": loop.worker.host_pages,
            },
        )  # fmt: skip
    )
    try:
        loop.run()
    except BaseException as exc:
        conn.send(("fatal", f"rank {spec.rank} failed: {type(exc).__name__}: {exc}", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        loop.close()


class RankLoop:
    def __init__(self, spec: RankSpec, conn: Any):
        from ikcode.engines.deepinfer.rank import RankWorker
        from ikcode.engines.deepinfer.request import RankRequest

        self.spec, self.conn, self.config = spec, conn, spec.config
        self._RankRequest = RankRequest
        self.backend = load_backend(spec.config.backend)
        self.worker = RankWorker(spec.rank, self.backend, spec.config, spec.eos_ids, self._emit)
        self.stop_requested = False
        self.steps = 0
        self.placeholder_steps = 0  # steps taken with nothing of this rank's own to run
        self._last_load: Any = None
        self._last_beat, self._beat_s = float("-inf"), beat_interval_s(spec.config.hung_rank_s)
        state_manager = self.worker.engine.state_manager
        self.initial_free_states = state_manager.get_num_free_blocks() if state_manager is not None else 0

    def _send(self, message: tuple) -> None:
        self.conn.send(message)

    def _emit(self, kind: LifecycleKind, r: Any) -> None:
        if not r.internal:
            self._send(("life", kind, r.request_id, dataclasses.replace(r.stats)))

    # ---- messages from the gateway ---------------------------------------------------------------
    def _take_messages(self, wait_s: float) -> None:
        if not self.conn.poll(wait_s):
            return
        while self.conn.poll(0):
            message = self.conn.recv()
            kind = message[0]
            if kind == "submit":
                request: EngineRequest = message[1]
                r = self._RankRequest(request, RemoteStream(request.request_id, self._send), message[2])
                r.stats.prompt_tokens = len(request.prompt_token_ids)
                r.stats.queued_at = time.monotonic()
                self.worker.hand_in(r)
            elif kind == "abort":
                self.worker.request_abort(message[1])
            elif kind == "call":
                _, call_id, name, args = message
                try:
                    result = getattr(self, "rpc_" + name)(*args)
                    self._send(("reply", call_id, True, result))
                except Exception as exc:
                    self._send(("reply", call_id, False, f"{type(exc).__name__}: {exc}"))
            elif kind == "host_pool":  # this rank's run of the node's shared host pool
                from ikcode.engines.deepinfer.host_pool import attach_pages

                _, name, first, count, page_bytes = message
                self.worker.cache.pages.host = attach_pages(name, first, count, page_bytes)
            elif kind == "stop":
                self.stop_requested = True
                self.worker.shutdown_requests()

    # ---- the lockstep loop -----------------------------------------------------------------------
    def run(self) -> None:
        import torch
        import torch.distributed as dist
        from deepinfer.model_executor.parallel_utils.parallel_state import PG

        group = PG.cpu_data_parallel_group()  # gloo (parallel_state.py: cpu_dp_group)
        idle = False
        while True:
            self._beat()  # before the step: the first one arms the gateway's watchdog
            self._take_messages(self.config.idle_wait_s if idle else 0.0)
            busy = self.worker.prepare()
            flags = torch.tensor([int(not self.stop_requested), int(busy)], dtype=torch.int64)
            if group.size() > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            if not flags.any().item():  # every rank told to stop, none busy: all stop together
                return
            unfinished = self.worker.engine.has_unfinished_requests()  # DeepInfer's all_reduce
            if unfinished and not busy:
                self.placeholder_steps += 1
            self.worker.drive(unfinished)
            self.steps += 1
            idle = not unfinished and not flags[1].item()
            self._push_load()

    def _beat(self) -> None:
        """Say this rank is alive (the gateway's watchdog takes a silent rank for hung)."""
        now = time.monotonic()
        if now - self._last_beat >= self._beat_s:
            self._last_beat = now
            self._send(("alive",))

    def _push_load(self) -> None:
        load = self.rpc_load()
        if load != self._last_load:
            self._last_load = load
            self._send(("load", self.spec.rank, load))

    def close(self) -> None:
        try:
            self.worker.engine.close()
        except Exception:
            log.exception("rank %d: engine close failed", self.spec.rank)

    # ---- calls from the gateway ------------------------------------------------------------------
    def rpc_resumable(self, hashes: list, prompt_len: int) -> int:
        return self.worker.cache.resumable_blocks(hashes, prompt_len, self.config.yoco_keep_tokens)

    def rpc_lookup(self, hashes: list, prompt_len: int) -> CacheLookup:
        n = self.rpc_resumable(hashes, prompt_len)
        m = self.worker.cache.cache.match(hashes[:n])
        return CacheLookup(prompt_len, m.device_blocks * KVSTORE_GRAIN, m.host_blocks * KVSTORE_GRAIN)

    def rpc_load(self) -> EngineLoad:
        w = self.worker
        live = list(w.live.values())
        free = w.blocks.get_num_free_blocks()
        evictable = len(w.cache.cache.policy)  # pinned by the cache alone: can be unpinned
        return EngineLoad(
            running=sum(1 for r in live if r.admitted and not r.closed),
            waiting=sum(1 for r in live if not r.admitted),
            kv_blocks_total=w.total_blocks, kv_blocks_used=w.total_blocks - free - evictable,
            kv_blocks_cached=w.cache.num_pinned, host_blocks_total=w.cache.cache.num_host_blocks,
            host_blocks_used=len(w.cache.cache.host),
        )  # fmt: skip

    def rpc_cache_stats(self) -> dict[str, float]:
        w = self.worker
        stats = dict(w.cache.cache.snapshot())
        stats.update(
            commit_failures=w.commit_failures, preempted=w.preempted, stall_guard_hits=w.stall_guard_hits
        )
        return stats

    def rpc_check(self) -> dict[str, Any]:
        """Invariants and the leak counters: blocks in use beyond the cache's pins, state slots in use."""
        w = self.worker
        w.cache.check()
        engine = w.engine
        free_states = engine.state_manager.get_num_free_blocks() if engine.state_manager is not None else 0
        total_states = engine.cache_config.num_state_seqs
        # engine blocks in the tables of the sequences the engine holds (the patched binding):
        # blocks in use = these + the cache's pinned blocks - the blocks counted in both
        in_sequences = {b for r in w.live.values() if r.admitted for b in r.seq.block_table}
        held = w.cache.cache.pool.index.keys() | w.cache.cache.host.index.keys()
        snapshots = w.cache.snapshots
        return {
            "rank": self.spec.rank, "live": len(w.live), "pending": len(w.pending),
            "blocks_total": w.total_blocks, "blocks_free": w.blocks.get_num_free_blocks(),
            "blocks_pinned": w.cache.num_pinned, "blocks_in_sequences": len(in_sequences),
            "cache_policy": type(w.cache.cache.policy).__name__,
            "blocks_pinned_in_sequences": len(in_sequences & set(w.cache.bound.values())),
            "blocks_copy_sources": len(w.cache.copy_sources),
            # window snapshots: all, those whose key neither tier holds any more, their bytes
            "snapshots": len(snapshots), "snapshots_lost_keys": len(snapshots.keys() - held),
            "snapshot_bytes": sum(int(getattr(v, "nbytes", 0)) for v in snapshots.values()),
            "state_slots_total": total_states,
            "state_slots_free": free_states, "state_slots_free_at_start": self.initial_free_states,
            "engine_unfinished": engine.get_num_unfinished_requests(),
            "steps": self.steps, "placeholder_steps": self.placeholder_steps,
            "forward_tokens": getattr(engine.driver_worker.model_runner, "forward_tokens", None),
            # the step settings DeepInfer's own SchedulerConfig took (config.py:185-206)
            "max_num_batched_tokens": engine.scheduler_config.max_num_batched_tokens,
            "prefill_attempt_interval": engine.scheduler_config.prefill_attempt_interval,
            "prefill_any_attempt_interval": engine.scheduler_config.prefill_any_attempt_interval,
        }  # fmt: skip
