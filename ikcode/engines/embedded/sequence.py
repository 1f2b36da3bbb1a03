"""One request inside the embedded engine: its tokens, its KV blocks and where it stands."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ikcode.cache import BlockHash, hash_blocks
from ikcode.engines.base import EngineRequest, FinishReason, RequestStats, RequestStream


class SequenceStatus(enum.Enum):
    """Where a sequence stands; only the Scheduler, which holds every live sequence, changes it."""

    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"  # last token out; may still hold blocks until released
    RELEASED = "released"  # blocks given back to the cache; no longer in the scheduler


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    stream: RequestStream
    max_total_tokens: int  # prompt + output may not pass this (context window or max_tokens)
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool (valid)
    block_table: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    generator: torch.Generator | None = None
    finish_reason: FinishReason | None = None
    release_at_step: int = 0
    num_preemptions: int = 0
    # Its long prefill sat out the last step for a tail (the scheduler lets it sit out one only).
    prefill_passed_over: bool = False
    # A caller asked to abort it; the engine thread ends it at its next step. A flag, not a
    # queue of ids, so that the scheduler's table stays the one record of the sequence.
    abort_requested: bool = False
    # Chained keys of the full blocks hashed so far. token_ids only ever grow, so a key once
    # computed stays right: admission retries (back-pressure), preemption and release reuse them.
    _block_hashes: list[BlockHash] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.request.prompt_token_ids)
        self.stats.prompt_tokens = len(self.token_ids)
        self.stats.queued_at = time.monotonic()
        s = self.request.sampling
        if s.temperature > 0:
            self.generator = torch.Generator()
            if s.seed is not None:
                self.generator.manual_seed(s.seed)
            else:
                self.generator.seed()

    @property
    def seq_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.token_ids) - self.num_computed_tokens

    def block_hashes(self, num_tokens: int, block_size: int) -> list[BlockHash]:
        """Keys of the full blocks among the first num_tokens tokens (hashed once each; the
        prompt's come with the request when the caller hashed it already)."""
        full = num_tokens // block_size
        known = self._block_hashes
        given = self.request.block_hashes
        if not known and given is not None:
            if given.usable(self.num_prompt_tokens, block_size, self.request.cache_salt):
                known.extend(given.hashes)
        if len(known) < full:
            start = len(known) * block_size
            chunk = self.token_ids[start : full * block_size]
            if known:  # the salt went into block 0's key; the chain carries it on
                known.extend(hash_blocks(chunk, block_size, parent=known[-1]))
            else:
                known.extend(hash_blocks(chunk, block_size, self.request.cache_salt))
        return known[:full]

    @property
    def is_decoding(self) -> bool:
        return self.num_pending_tokens == 1 and self.num_output_tokens > 0
