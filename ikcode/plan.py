"""Capacity planning: how many conversations each tier holds and how many can be busy at once.

The lesson of the published 200-agent run: host RAM rescues idle sessions only. A session is
on the GPU while its turn runs (prompt read, answer decoded), so the GPU tier must hold every
session that is active at once; the host tier only decides how cheaply a returning one comes
back. `plan()` puts numbers on that for a hardware profile, a conversation size and an agent count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ikcode.engines.simulated import HardwareModel

VERDICT = "size the GPU tier for sessions active at once"


@dataclass(frozen=True)
class PlanLoad:
    """How an agent spends its time (defaults: the bench's agents)."""

    output_tokens: int = 200
    tool_pause_s: float = 6.6  # mean of the bench's lognormal pause (median 4 s)
    frontend_s: float | None = None  # None: from the hardware figure


def plan(hw: HardwareModel, context_tokens: int, agents: int, load: PlanLoad | None = None) -> dict[str, Any]:
    if context_tokens < 1 or agents < 0:
        raise ValueError(f"need context_tokens >= 1 and agents >= 0, got {context_tokens} and {agents}")
    load = load or PlanLoad()
    per_conv = context_tokens + load.output_tokens
    on_gpu = hw.device_tier_tokens // per_conv
    on_host = hw.host_tier_tokens // per_conv
    # One agent's cycle when nothing queues: front end, its new tokens, decode, tool pause. The
    # conversation occupies GPU memory from admission to release (prefill tail + decode).
    decode_step = hw.decode_step_seconds(max(1, min(agents, on_gpu)), min(agents, on_gpu) * context_tokens)
    decode_s = load.output_tokens * decode_step
    frontend_s = hw.frontend_seconds(context_tokens) if load.frontend_s is None else load.frontend_s
    busy_s = decode_s + hw.prefill_seconds(context_tokens, 2048)
    cycle_s = frontend_s + busy_s + load.tool_pause_s
    duty = busy_s / cycle_s
    active = agents * duty
    fits_active = active <= on_gpu
    fits_all = agents <= on_gpu
    max_agents = int(on_gpu / duty) if duty > 0 else on_gpu
    cold_read_s = hw.prefill_seconds(0, context_tokens)
    if fits_all:
        status = f"all {agents} sessions fit in the GPU tier ({on_gpu} of this size)"
    elif fits_active:
        status = (
            f"{agents} sessions exceed the GPU tier ({on_gpu}) but the ~{active:.0f} active at once fit; "
            f"idle ones wait in host RAM ({on_host:,} fit there) and reload in "
            f"{hw.reload_seconds(context_tokens):.2f} s"
        )
    else:
        status = (
            f"~{active:.0f} sessions active at once exceed the GPU tier ({on_gpu}): turns wait for "
            f"GPU memory whatever the host tier holds; at most ~{max_agents} such agents"
        )
    return {
        "hardware": hw.name,
        "context_tokens": context_tokens,
        "agents": agents,
        "kv_bytes_per_token": hw.kv_bytes_per_token,
        "conversation_bytes": per_conv * hw.kv_bytes_per_token,
        "gpu_tier_tokens": hw.device_tier_tokens,
        "host_tier_tokens": hw.host_tier_tokens,
        "gpu_tier_bytes": hw.device_tier_tokens * hw.kv_bytes_per_token,
        "host_tier_bytes": hw.host_tier_tokens * hw.kv_bytes_per_token,
        "conversations_on_gpu": on_gpu,
        "conversations_in_host": on_host,
        "agent_cycle_s": cycle_s,
        "agent_busy_share": duty,
        "active_at_once": active,
        "max_agents_at_this_size": max_agents,
        "cold_read_s": cold_read_s,
        "reload_s": hw.reload_seconds(context_tokens),
        "no_cache_read_tokens_per_s": hw.cold_read_tokens_per_s(context_tokens),
        "fits_gpu_all": fits_all,
        "fits_gpu_active": fits_active,
        "status": status,
        "verdict": VERDICT,
    }
