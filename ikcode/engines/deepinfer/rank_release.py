"""How a DeepInfer rank ends its requests: the stream's final event, preemption, the commit in
finalize_seq, release, aborts at every stage, and failures.

Runs on the rank's engine thread; see rank.py for the state it works on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from ikcode.cache import hash_blocks
from ikcode.engines.base import (
    EngineError,
    EngineOverloaded,
    FinishReason,
    LifecycleKind,
    TokenEvent,
)
from ikcode.engines.deepinfer.config import KVSTORE_GRAIN
from ikcode.engines.deepinfer.request import RankRequest

log = logging.getLogger(__name__)


class RankRelease:
    """Release half of RankWorker (its attributes are set in RankWorker.__init__)."""

    rank: int
    config: Any
    engine: Any
    scheduler: Any
    cache: Any
    lock: Any
    pending: Any
    live: dict[str, RankRequest]
    preempted: int
    emit: Any

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


def _is_waiting(seq: Any) -> bool:
    """Still queued in the engine (not yet scheduled). Read from the bound status enum."""
    status = getattr(seq, "status", None)
    return str(getattr(status, "name", status)).upper().endswith("WAITING")
