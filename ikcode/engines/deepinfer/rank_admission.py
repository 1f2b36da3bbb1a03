"""How a DeepInfer rank admits its pending requests into the engine: the priming pass, the
sequence's allocation (with the prefill-stall guard), and the cache hit copied into it.

Runs on the rank's engine thread (RankWorker.prepare); see rank.py for the state it works on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from ikcode.engines.base import EngineError, EngineOverloaded, LifecycleKind, RequestStream
from ikcode.engines.deepinfer.config import KVSTORE_GRAIN
from ikcode.engines.deepinfer.request import RankRequest

log = logging.getLogger(__name__)

_QUERY_STATS = (
    "requests", "query_tokens", "query_blocks", "hit_tokens_device", "hit_tokens_host",
    "hit_blocks_device", "hit_blocks_host",
)  # fmt: skip
NO_BINDING = (
    "this deepinfer build does not expose Sequence.block_table: apply ikcode's patch "
    "(ikcode/engines/deepinfer/patches/README.md) and rebuild"
)


class RankAdmission:
    """Admission half of RankWorker (its attributes are set in RankWorker.__init__)."""

    rank: int
    backend: Any
    config: Any
    engine: Any
    scheduler: Any
    blocks: Any
    cache: Any
    lock: Any
    pending: Any
    live: dict[str, RankRequest]
    reserve_blocks: int
    stall_guard_hits: int
    emit: Any
    _fail: Any

    def _admit_pending(self) -> None:
        for r in list(self.pending):
            if r.prime is not None and r.prime.stats.released_at is None:
                continue  # its priming pass runs first
            if r.seq is None and not r.internal and r.cached_before_prime is None and self._start_prime(r):
                continue
            try:
                if r.seq is None:
                    self._add(r)
            except Exception as exc:
                self.pending.remove(r)
                if r.seq is not None:
                    self.engine.abort_request(r.request_id)
                self._fail(r, exc)
                continue
            prompt_len = len(r.request.prompt_token_ids)
            blocks = -(-prompt_len // KVSTORE_GRAIN)
            with self.lock:  # room for the whole prompt, taken from the hit it is about to copy last
                n = self.cache.resumable_blocks(r.hashes, prompt_len, self.config.yoco_keep_tokens)
                self.cache.evict_for(blocks + self.reserve_blocks, keep=r.hashes[:n])
            allocated = self.scheduler.try_allocate_seq(r.seq)
            if allocated and self.blocks.get_num_free_blocks() < self.reserve_blocks:
                # Prefill-stall guard: past the watermark DeepInfer admits no prefill
                # (scheduler.hpp:80, 313) and has no eviction of its own; admitting this one now
                # could leave every sequence waiting. Give the blocks back and retry later.
                self.scheduler.free_seq(r.seq)
                # free_seq frees the state slot but leaves its id on the Sequence
                # (scheduler.hpp:738-741), and try_allocate_seq refuses a Sequence that has one
                # (block_manager.hpp:221, "state already allocated"): the retry must see -1.
                r.seq.state_id = -1
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

    def _add(self, r: RankRequest) -> None:
        s = r.request.sampling
        params = self.backend.SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1,
            max_tokens=s.max_tokens, seq_seed=s.seed if s.seed is not None else self.config.seed,
            ignore_eos=s.ignore_eos,  # its default stops at EOS (sampling_params.py:51, scheduler.hpp:1038)
        )  # fmt: skip
        prompt = np.asarray(r.request.prompt_token_ids, dtype=np.int32)
        user = r.request.cache_salt or "ikcode"
        r.seq = self.engine.add_request(user, r.request_id, params, prompt, enqueue=False)
        if r.seq is None:
            # Refused before a Sequence exists (bad token ids, llm_engine.py:584-589): no output
            # will ever come for it, so it fails here.
            raise EngineError(f"DeepInfer refused the prompt of {r.request_id} (a token id out of its range)")
        if not hasattr(r.seq, "block_table"):
            raise RuntimeError(NO_BINDING)

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
            kept = min(device, before[0]), min(host, before[1])
            with self.lock:  # the cache's counters say what the request's stats say
                stats = self.cache.cache.stats
                extra_device, extra_host = device - kept[0], host - kept[1]  # never negative
                stats.hit_tokens_device -= extra_device
                stats.hit_blocks_device -= extra_device // KVSTORE_GRAIN
                stats.hit_tokens_host -= extra_host
                stats.hit_blocks_host -= extra_host // KVSTORE_GRAIN
            device, host = kept
        r.stats.cached_tokens_device, r.stats.cached_tokens_host = device, host
        r.stats.computed_tokens = prompt_len - device - host
        r.stats.admitted_at = time.monotonic()
        self.emit(LifecycleKind.ADMITTED, r)
