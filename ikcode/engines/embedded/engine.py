"""EmbeddedEngine: the Engine protocol over a PyTorch model, a paged KV pool and the prefix cache.

One engine thread owns every model call, every cache mutation and every event. `submit`
validates on the caller's thread (typed errors with the numbers) and adds the sequence to the
scheduler, which holds every sequence from submit to release and its status (one table, under
`_lock`); `abort` only marks it there. Each step: end what was aborted, schedule, one forward over
the batch, sample, emit events, release what is due.

Lifecycle: FINISHED (last token out) comes before RELEASED (blocks back to the cache, cache
entries committed). Until release the sequence keeps its blocks, and nothing of it is committed:
committing at the final token, while an engine still holds the sequence, is the published
silent-miss bug. `release_step` says when a finished sequence is released (at the end of its last
step here; engines that close a sequence steps later are reproduced by overriding it) and
`blocks_to_commit` what is committed then.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch

from ikcode.cache import BlockHash, hash_blocks
from ikcode.engines.base import (
    CacheLookup,
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
    check_request,
)
from ikcode.engines.embedded.config import EmbeddedEngineConfig
from ikcode.engines.embedded.kv_pools import build_kv_pools, resolve_device
from ikcode.engines.embedded.sampler import sample, sample_rows
from ikcode.engines.embedded.scheduler import ScheduledSeq, Scheduler, committable_hashes
from ikcode.engines.embedded.sequence import Sequence, SequenceStatus
from ikcode.engines.embedded.threads import hand_threads_to_engine
from ikcode.model.config import ModelConfig

logger = logging.getLogger(__name__)


class EmbeddedEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        config: EmbeddedEngineConfig | None = None,
    ):
        self.config = config = config or EmbeddedEngineConfig()
        config.validate()
        # The engine thread alone runs torch's kernels multi-threaded (threads.py says why).
        self.num_threads = hand_threads_to_engine(config.num_threads)
        self.model_config = model_config
        self.device = resolve_device(config.device)
        block_size = config.block_size
        pools = build_kv_pools(model_config, state_dict, config, self.device)
        self.runner, self.cache, self.num_blocks = pools.runner, pools.cache, pools.num_blocks
        self.scheduler = Scheduler(
            self.cache,
            config.max_num_seqs,
            config.max_prefill_tokens_per_step,
            config.long_prefill_chunk_tokens,
        )
        # A sequence must fit the pool on its own, or preemption could never make room for it.
        self.context_window = min(model_config.max_position_embeddings, self.num_blocks * block_size)
        self._info = EngineInfo(
            model_name=config.model_name or model_config.name,
            context_window=self.context_window,
            vocab_size=model_config.vocab_size,
            eos_token_ids=tuple(model_config.eos_token_ids),
            block_size=block_size,
            kind="embedded",
            device=str(self.device),
        )
        self._lock = threading.Lock()  # the scheduler (every sequence's state) and the cache
        self._wake = threading.Event()
        self._listeners: list[LifecycleListener] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._abort_all = False
        self.steps = 0

    # ---- Engine protocol ---------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return self._info

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ikcode-embedded-engine", daemon=True)
                self._thread.start()

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        self._stopping = True
        deadline = time.monotonic() + drain_timeout_s
        while time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            if self.idle():
                break
            time.sleep(0.01)
        self._abort_all = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def submit(self, request: EngineRequest) -> RequestStream:
        if self._stopping:
            raise EngineShutdown()
        prompt = request.prompt_token_ids
        # context_window - 1: room for at least one output token.
        check_request(request, self.context_window - 1, self.model_config.vocab_size)
        stream = RequestStream(request.request_id, on_abort=self.abort)
        limit = min(self.context_window, len(prompt) + request.sampling.max_tokens)
        seq = Sequence(request, stream, max_total_tokens=limit)
        with self._lock:
            if self._stopping:  # checked again under the lock: shutdown may have begun
                raise EngineShutdown()
            if self.scheduler.get(request.request_id) is not None:
                raise EngineError(f"request id {request.request_id!r} is already in use")
            self.scheduler.add(seq)
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.scheduler.request_abort(request_id)
        self._wake.set()

    def lookup(
        self, prompt_token_ids: list[int], cache_salt: str = "", block_hashes: PromptBlockHashes | None = None
    ) -> CacheLookup:
        bs = self.config.block_size
        if block_hashes is not None and block_hashes.usable(len(prompt_token_ids), bs, cache_salt):
            hashes = block_hashes.hashes
        else:
            hashes = hash_blocks(prompt_token_ids, bs, cache_salt)
        n = len(prompt_token_ids)
        with self._lock:
            m = self.cache.match(hashes)
            # As admission reads it: the block holding the last prompt token is always computed.
            reusable = self.cache.reusable_blocks(n, len(hashes))
        device_blocks = min(m.device_blocks, reusable)
        device = device_blocks * bs
        host = min(m.host_blocks, reusable - device_blocks) * bs
        return CacheLookup(prompt_tokens=n, device_tokens=device, host_tokens=host)

    def load(self) -> EngineLoad:
        with self._lock:
            # Unreferenced blocks holding a key are exactly the evictable ones the policy orders:
            # O(1), where counting the index took a pass over every cached block per call.
            cached = len(self.cache.pool.policy)
            return EngineLoad(
                running=len(self.scheduler.with_status(SequenceStatus.RUNNING)),
                waiting=len(self.scheduler.with_status(SequenceStatus.WAITING)),
                kv_blocks_total=self.num_blocks,
                kv_blocks_used=self.num_blocks - self.cache.num_free_blocks(),
                kv_blocks_cached=cached,
                host_blocks_total=self.cache.num_host_blocks,
                host_blocks_used=len(self.cache.host.index),
            )

    def idle(self) -> bool:
        """No request queued, running, or finished but not yet released."""
        with self._lock:
            return not self.scheduler.has_work()

    def add_listener(self, listener: LifecycleListener) -> None:
        self._listeners.append(listener)

    # ---- engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            if not self._abort_all:  # ended without shutdown (a BaseException got through)
                logger.error("the engine thread stopped; failing its requests and refusing new ones")
                self._stopping = True
                try:
                    self._abort_everything()
                except Exception:
                    logger.exception("ending the requests of a stopped engine failed")

    def _serve(self) -> None:
        torch.set_num_threads(self.num_threads)
        while True:
            if self._abort_all:
                self._abort_everything()
                return
            with self._lock:
                busy = self.scheduler.has_work()
            if not busy:
                self._wake.wait(self.config.idle_wait_s)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as exc:  # never let the thread die: fail what was running
                logger.exception("engine step failed")
                with self._lock:
                    running = self.scheduler.with_status(SequenceStatus.RUNNING)
                for seq in running:
                    self._fail(seq, exc)

    @torch.inference_mode()
    def step(self) -> None:
        """One engine step: end what was aborted, schedule, one forward over the batch, sample,
        release what is due. The engine thread loops over it; tests call it directly."""
        self.steps += 1
        with self._lock:
            aborted = self.scheduler.take_aborted()
        for seq in aborted:
            self._finish(seq, FinishReason.ABORT, [])
        with self._lock:
            plan = self.scheduler.schedule()
        for seq, exc in plan.failed:
            self._fail(seq, exc)
        # Listeners run outside the lock: one that calls back into the engine (load()) must not
        # deadlock the engine thread.
        for seq in plan.admitted:
            self._emit(LifecycleKind.ADMITTED, seq)
        if plan.scheduled:
            self._run(plan.scheduled)
        with self._lock:
            due = self.scheduler.due(self.steps)
        for seq in due:
            self._release(seq)

    def _run(self, scheduled: list[ScheduledSeq]) -> None:
        try:
            logits, which = self.runner.run(scheduled)
        except Exception as exc:
            if len(scheduled) > 1:
                # One request's failure (a chunk too big for memory, a bad input) must not end
                # the others in its batch: each runs again alone and only a failing one fails.
                # Nothing has advanced yet, so a rerun writes the same K/V slots again.
                logger.warning("forward failed for %d sequences; running them one by one", len(scheduled))
                for item in scheduled:
                    self._run([item])
                return
            logger.exception("forward failed for %s", scheduled[0].seq.seq_id)
            self._fail(scheduled[0].seq, exc)
            return
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_tokens
        seqs = [scheduled[index].seq for index in which]
        for seq, token in zip(seqs, self._sample(logits, seqs), strict=True):
            if isinstance(token, Exception):
                self._fail(seq, token)
                continue
            try:
                self._append_token(seq, token)
            except Exception as exc:
                self._fail(seq, exc)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | Exception]:
        """Each row's next token, or what sampling it raised. All rows at once; if that raises,
        row by row from the generators' states before the attempt, so one request's failure
        fails only that request and a seeded request's draws are the ones it would have had."""
        states = [seq.generator.get_state() if seq.generator is not None else None for seq in seqs]
        try:
            return sample_rows(
                logits,
                [seq.request.sampling for seq in seqs],
                [seq.generator for seq in seqs],
                [seq.token_ids for seq in seqs],
            )
        except Exception:
            logger.warning("sampling %d rows at once failed; sampling them one by one", len(seqs))
        tokens: list[int | Exception] = []
        for row, (seq, state) in enumerate(zip(seqs, states, strict=True)):
            if state is not None:
                seq.generator.set_state(state)
            try:
                tokens.append(sample(logits[row], seq.request.sampling, seq.generator, seq.token_ids))
            except Exception as exc:
                tokens.append(exc)
        return tokens

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        now = time.monotonic()
        stats = seq.stats
        stats.output_tokens = seq.num_output_tokens
        first = stats.first_token_at is None
        if first:
            stats.first_token_at = now
            self._emit(LifecycleKind.FIRST_TOKEN, seq)
        params = seq.request.sampling
        reason = None
        if (
            token in self.model_config.eos_token_ids and not params.ignore_eos
        ) or token in params.stop_token_ids:
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= seq.max_total_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(seq, reason, [token])
        else:
            seq.stream.put(
                TokenEvent(seq.seq_id, [token], stats=dataclasses.replace(stats) if first else None)
            )

    def _finish(
        self, seq: Sequence, reason: FinishReason, tokens: list[int], error: EngineError | None = None
    ) -> None:
        """Final event now; the blocks go back at release (now for errors and aborts)."""
        holds_blocks = seq.status is SequenceStatus.RUNNING
        normal = error is None and reason is not FinishReason.ABORT
        with self._lock:
            self.scheduler.finish(seq, self.release_step(seq) if normal else self.steps)
        seq.finish_reason = reason
        seq.stats.finished_at = time.monotonic()
        seq.stats.output_tokens = seq.num_output_tokens
        self._emit(LifecycleKind.FINISHED, seq)
        seq.stream.put(
            TokenEvent(
                seq.seq_id,
                tokens,
                finished=True,
                finish_reason=reason,
                stats=dataclasses.replace(seq.stats),
                error=error,
            )
        )
        if not holds_blocks:  # never admitted: nothing to give back or commit
            with self._lock:
                self.scheduler.release(seq, [])
        elif error is not None:
            self._release(seq, commit=False)  # its K/V may be garbage: free without committing
        elif reason is FinishReason.ABORT:
            self._release(seq)
        # else: released by step() when its release step comes

    # ---- what a finished sequence gives back, and when (subclasses reproduce other engines) ---
    def release_step(self, seq: Sequence) -> int:
        """The step at whose end a finished sequence is released: the step of its final token."""
        return self.steps

    def blocks_to_commit(self, seq: Sequence) -> list[BlockHash]:
        """Keys of seq's blocks committed to the cache at its release: the full blocks whose K/V
        is valid."""
        return committable_hashes(seq, self.config.block_size)

    def _release(self, seq: Sequence, commit: bool = True) -> None:
        try:
            committed = self.blocks_to_commit(seq) if commit else []
        except Exception:  # released all the same, committing nothing: else it stays due for ever
            logger.exception("no blocks of %s could be committed", seq.seq_id)
            committed = []
        request = seq.request
        # A hold only for a normal finish: an aborted or failed request's client is gone.
        normal = seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        hold_s = request.hold_tail_s if normal else None
        session = request.session_id
        try:
            with self._lock:
                self.scheduler.release(seq, committed, session_id=session, hold_s=hold_s, step=normal)
        except Exception:  # a failed write-through copy: the blocks are released, the request done
            logger.exception("cache commit failed for %s", seq.seq_id)
        seq.stats.released_at = time.monotonic()
        self._emit(LifecycleKind.RELEASED, seq)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        if seq.status not in (SequenceStatus.WAITING, SequenceStatus.RUNNING):
            return
        error = exc if isinstance(exc, EngineError) else EngineError(f"internal engine error: {exc!r}")
        self._finish(seq, FinishReason.ERROR, [], error)

    def _abort_everything(self) -> None:
        """Shutdown's last pass: end every sequence still known, release every finished one."""
        with self._lock:
            live = list(self.scheduler.seqs.values())
        for seq in live:
            if seq.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING):
                self._finish(seq, FinishReason.ABORT, [], EngineShutdown())
            elif seq.status is SequenceStatus.FINISHED:
                self._release(seq)

    def _emit(self, kind: LifecycleKind, seq: Sequence) -> None:
        event = LifecycleEvent(kind, seq.seq_id, time.monotonic(), dataclasses.replace(seq.stats))
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                logger.exception("lifecycle listener failed")
