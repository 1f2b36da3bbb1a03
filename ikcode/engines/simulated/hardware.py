"""HardwareModel: the cost model of one GPU server, in seconds per step.

Everything is the whole server (all cards together): data-parallel ranks with session
affinity are approximated as one pool with the sum of their rates. The profile's `[hardware]`
table maps onto these fields one to one; the derivation of each figure for a profile lives in
that profile's comments.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class HardwareModel:
    name: str = "generic"
    # Prefill: one token at context position p costs prefill_s_per_token + attention_s_per_token_ctx * p
    # (the linear term is the MLPs/projections; the second is attention over what came before).
    prefill_s_per_token: float = 4.0e-6
    attention_s_per_token_ctx: float = 4.44e-12
    # Tokens of prefill per engine step over all cards (chunked prefill budget).
    prefill_chunk_tokens: int = 32_768
    # Decode step: fixed cost (weights, launch) + per sequence in the batch + per token of
    # context read by attention across the batch.
    decode_base_s: float = 0.012
    decode_per_seq_s: float = 1.5e-4
    decode_per_ctx_token_s: float = 4.0e-14
    # Memory: KV bytes per token of the model, tier capacities in tokens.
    kv_bytes_per_token: int = 6386
    device_tier_tokens: int = 57_000_000
    host_tier_tokens: int = 617_000_000
    # Host -> device reload bandwidth (bytes/s, all cards) for host-tier hits.
    reload_bytes_per_s: float = 2.048e11
    max_num_seqs: int = 1024
    # The serving path in front of the GPU, per prompt token, paid by every turn in parallel
    # (client serializes and sends the conversation, the server parses, renders and tokenizes
    # it and hashes its blocks). 0 for an ideal front end.
    frontend_s_per_token: float = 0.0
    cards: int = 4
    # Derived figures kept for plan/reports (not used by the step costs).
    card_memory_bytes: float = 180e9
    weights_bytes: float = 284e9

    def prefill_seconds(self, start: int, tokens: int) -> float:
        """Time to prefill `tokens` tokens that start at context position `start`."""
        if tokens <= 0:
            return 0.0
        mean_pos = start + tokens / 2
        return tokens * (self.prefill_s_per_token + self.attention_s_per_token_ctx * mean_pos)

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        per_seq = self.decode_per_seq_s * batch
        return self.decode_base_s + per_seq + self.decode_per_ctx_token_s * context_tokens

    def frontend_seconds(self, prompt_tokens: int) -> float:
        return prompt_tokens * self.frontend_s_per_token

    def reload_seconds(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.reload_bytes_per_s if tokens > 0 else 0.0

    def cold_read_tokens_per_s(self, context_tokens: int) -> float:
        """Read rate with no cache: a conversation of this size read from zero, alone."""
        seconds = self.prefill_seconds(0, context_tokens)
        return context_tokens / seconds if seconds > 0 else 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, name: str | None = None) -> HardwareModel:
        data = dict(data or {})
        if name is not None:
            data.setdefault("name", name)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown [hardware] keys: {', '.join(unknown)}")
        return cls(**data)
