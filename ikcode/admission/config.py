"""AdmissionConfig: every knob of the admission layer, each with a default that serves.

The profile's `[admission]` table maps onto these fields one to one (`AdmissionConfig.from_dict`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

POLICIES = ("fifo", "ikcode")


RETIRED_KEYS = ("cold_share", "share_window_s")


@dataclass(frozen=True)
class AdmissionConfig:
    # "fifo": pass requests through in arrival order, no caps, no shedding (the baseline a plain
    # engine gives). "ikcode": warm-first with aging, cold caps, a cold share, shedding.
    policy: str = "ikcode"
    # A request whose uncached tokens (after lookup; host-tier hits count as cached, since a
    # reload over PCIe is 30-90x cheaper than recomputing) exceed this is cold.
    cold_threshold_tokens: int = 32_768
    # Cold prefills inside the engine at once, on each rank (a data-parallel engine's rank has its
    # own prefill compute and memory; see admission.gate). One or two keeps warm turns from
    # queueing behind a wall of brand-new long conversations.
    max_cold_prefills: int = 2
    # A cold request waiting this long ranks with the warm ones (aging: nothing starves).
    aging_s: float = 20.0
    # Shed a NEW session's cold request (529 + retry-after) when its predicted TTFT exceeds this
    # and it cannot start for at least min_retry_after_s (no rank has a free cold slot); the
    # retry-after is the predicted wait, so it comes back when the work ahead of it is done.
    ttft_bound_s: float = 15.0
    shed: bool = True
    max_retry_after_s: int = 60  # Claude Code honours retry-after up to 60 s
    min_retry_after_s: int = 1
    # Prior for the prefill rate (tokens/s of the whole server, all ranks); refined online from
    # completed prefills. 0 = no prior: nothing is shed until a few prefills were measured.
    prefill_tokens_per_s: float = 0.0
    rate_ema_alpha: float = 0.2
    rate_min_tokens: int = 4096  # prefills smaller than this say little about the rate
    # A session seen within this many seconds is "running": its cold steps (e.g. after an
    # eviction) are never shed, only queued.
    session_memory_s: float = 3600.0
    # Hold requests in admission (instead of the engine's own queue) while the engine's device
    # KV memory cannot take them; the order of admission then decides who gets memory.
    memory_gate: bool = True
    # Sessions active at once (ikcode.admission.sessions): "plan" = the most agents `ikcode plan`
    # computes for the profile's [hardware] figures at the size of the conversations in progress
    # (no limit for a profile without them); a number = that many; 0 = no limit. A new session
    # past it waits for a slot (shed once with 529 + retry-after, then queued): past plan's limit
    # every turn of every session slows, where this way only a new session's first turn waits.
    max_active_sessions: int | str = "plan"
    # A session holds its slot this long after its last request ended: long enough that a working
    # session keeps it through its tool runs (lognormal, median 4 s in the bench: 2% of pauses are
    # over 30 s, 0.03% over 120 s). A session released while it was only pausing gets a slot back
    # at once, but its slot went to a new session, whose cold read then runs on top of the limit:
    # at 200 x 500K with 30 s, the median of every turn was 3.1 s instead of 1.7 s
    # (bench/simulate_trace.py --set session_idle_s=30 shows it).
    session_idle_s: float = 120.0
    max_queue: int = 100_000  # beyond this even warm work is refused (EngineOverloaded)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"admission policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_cold_prefills < 1:
            raise ValueError("max_cold_prefills must be >= 1 (cold work must always progress)")
        limit = self.max_active_sessions
        if limit != "plan" and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f'max_active_sessions must be "plan" or a number >= 0, got {limit!r}')
        if self.session_idle_s < 0:
            raise ValueError(f"session_idle_s must be >= 0, got {self.session_idle_s}")
        if not (1 <= self.max_retry_after_s <= 60):
            raise ValueError("max_retry_after_s must be in [1, 60]: clients ignore longer waits")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, **overrides: Any) -> AdmissionConfig:
        """Build from a profile's [admission] table; unknown keys are an error that names them."""
        # Knobs of a step planner no engine ran (the engine schedules its own chunks): profiles
        # written before it was removed still set them, and mean nothing now.
        data = {k: v for k, v in (data or {}).items() if k not in RETIRED_KEYS}
        data.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            names = ", ".join(sorted(known))
            raise ValueError(f"unknown [admission] keys: {', '.join(unknown)}; known: {names}")
        for f in fields(cls):
            if f.name in data:
                _check_kind(f.name, data[f.name], str(f.type))
        return cls(**data)


def _check_kind(key: str, value: Any, annotation: str) -> None:
    """An [admission] value of the kind its knob takes ("x" for a number of seconds was taken,
    and failed only when a request compared with it)."""
    if annotation in ("float", "int"):
        whole = annotation == "int"
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or (whole and not isinstance(value, int)) or not math.isfinite(value):
            raise ValueError(
                f"[admission] {key} must be {'a whole number' if whole else 'a number'}, got {value!r}"
            )
    elif annotation == "bool" and not isinstance(value, bool):
        raise ValueError(f"[admission] {key} must be true or false, got {value!r}")
    elif annotation == "str" and not isinstance(value, str):
        raise ValueError(f"[admission] {key} must be a string, got {value!r}")
