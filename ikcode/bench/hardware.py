"""HardwareModel: one card of a data-parallel DeepInfer server, from physical figures.

Each data-parallel rank is one process on one card (facts: Several GPUs) with its own KV memory,
its own prefill compute and its own decode bandwidth; nothing is pooled across ranks. The
profile's `[hardware]` table maps onto these fields one to one and writes the arithmetic of each
figure beside it. Exactly one figure is calibrated (`prefill_flops_per_s`, on the published
no-cache read rate); every other published number is a prediction of the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

# Figures a sensitivity row may scale by +-20% (the others are the engine's own settings).
DERIVED_FIGURES = (
    "prefill_flops_per_s",
    "active_params",
    "kv_bytes_per_token",
    "hbm_bytes_per_s",
    "pcie_bytes_per_s",
    "weights_bytes",
    "card_memory_bytes",
)


@dataclass(frozen=True)
class HardwareModel:
    name: str = "generic"
    cards: int = 4  # data-parallel ranks, one per card
    card_memory_bytes: float = 180e9  # HBM per card
    memory_utilization: float = 0.9  # DeepInfer's gpu_memory_utilization: weights + KV
    weights_bytes: float = 284e9  # the whole model; each card holds weights_bytes / cards (EP)
    active_params: float = 13e9  # parameters a token passes through (MoE: the active experts)
    prefill_flops_per_s: float = 1.3e15  # achieved by one card in prefill (the calibrated figure)
    hbm_bytes_per_s: float = 8e12  # per card
    pcie_bytes_per_s: float = 64e9  # per card, host <-> device
    kv_bytes_per_token: int = 6386
    host_tier_tokens: int = 617_000_000  # host RAM for the KV host tier, all ranks together
    # The engine's own settings (DeepInfer 0.1.0 defaults unless the profile sets them).
    max_num_seqs: int = 256  # per rank
    max_num_batched_tokens: int = 1_048_576  # prefill tokens per step and rank (config.py:228)
    prefill_watermark: float = 0.9  # scheduler.hpp:80, 313
    prefill_attempt_interval: int = 70  # decode steps between ALL-ranks prefill votes (environ.py:174)
    prefill_any_attempt_interval: int = 100  # decode steps between ANY-rank prefill votes (environ.py:177)

    # ---- derived, per card -------------------------------------------------------------------
    @property
    def weights_per_card_bytes(self) -> float:
        return self.weights_bytes / self.cards

    @property
    def kv_bytes_per_card(self) -> float:
        """What gpu_memory_utilization leaves for KV after the card's share of the weights; the
        other (1 - utilization) of the card is activations and workspace."""
        return max(0.0, self.card_memory_bytes * self.memory_utilization - self.weights_per_card_bytes)

    @property
    def kv_tokens_per_card(self) -> int:
        return int(self.kv_bytes_per_card // self.kv_bytes_per_token)

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.active_params

    def prefill_seconds(self, tokens: int) -> float:
        """One card computing `tokens` prompt tokens."""
        return tokens * self.flops_per_token / self.prefill_flops_per_s if tokens > 0 else 0.0

    def decode_step_seconds(self, context_tokens: int) -> float:
        """One decode step of one card: its weights read once, plus the KV its batch attends to
        (an upper bound: all of it). An idle rank still steps (placeholder forwards), weights only."""
        return (self.weights_per_card_bytes + context_tokens * self.kv_bytes_per_token) / self.hbm_bytes_per_s

    def copy_seconds(self, tokens: int) -> float:
        """KV of `tokens` tokens over one card's PCIe link (host tier reload or demotion)."""
        return tokens * self.kv_bytes_per_token / self.pcie_bytes_per_s if tokens > 0 else 0.0

    def cold_read_tokens_per_s(self) -> float:
        """No cache: every card reads its own conversations from zero, all cards at once."""
        return self.cards * self.prefill_flops_per_s / self.flops_per_token

    def scaled(self, figure: str, factor: float) -> HardwareModel:
        if figure not in DERIVED_FIGURES:
            raise ValueError(f"unknown figure {figure!r} (known: {', '.join(DERIVED_FIGURES)})")
        value = getattr(self, figure) * factor
        return replace(self, **{figure: type(getattr(self, figure))(value)})

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, name: str | None = None) -> HardwareModel:
        data = dict(data or {})
        if name is not None:
            data.setdefault("name", name)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown [hardware] keys: {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        for f in fields(cls):
            if f.name in data and f.name != "name":
                _check_figure(f.name, data[f.name], whole=f.type == "int")
        return cls(**data)


# Figures that may be 0 (no host tier); fractions that may not exceed 1. Every other figure is > 0.
_MAY_BE_ZERO = ("host_tier_tokens",)
_FRACTIONS = ("memory_utilization", "prefill_watermark")


def _check_figure(key: str, value: Any, whole: bool) -> None:
    """A [hardware] figure is a finite number of the right kind and range, or a ValueError that
    names it (a string, 0 or a negative count would divide by zero or plan negative agents)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or (whole and not isinstance(value, int)) or not math.isfinite(value):
        kind = "a whole number" if whole else "a number"
        raise ValueError(f"[hardware] {key} must be {kind}, got {value!r}")
    low_ok = value >= 0 if key in _MAY_BE_ZERO else value > 0
    if not low_ok or (key in _FRACTIONS and value > 1):
        bound = "in (0, 1]" if key in _FRACTIONS else (">= 0" if key in _MAY_BE_ZERO else "> 0")
        raise ValueError(f"[hardware] {key} must be {bound}, got {value!r}")


def adapter_schedule(profile: Any) -> dict[str, int]:
    """The engine step settings ikcode's DeepInfer adapter passes live for this profile (its
    [deepinfer] table over the adapter's defaults); the simulator's ikcode rows run these, the
    fifo baseline DeepInfer's own defaults (the HardwareModel fields). Empty for other engines."""
    if getattr(profile, "engine", "") != "deepinfer":
        return {}
    from ikcode.engines.deepinfer.config import DeepInferConfig

    return DeepInferConfig.from_profile(profile, model_path="").schedule()
