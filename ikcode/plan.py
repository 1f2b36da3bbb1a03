"""Capacity planning on the simulator's model: do the agents fit, by how much, and how many would.

The lesson of the published 200-agent run: a conversation must be on its rank's GPU while its turn
runs, and the GPU tier is per card. Two limits follow, from the same per-card figures the
simulator uses (ikcode.bench.hardware):
- resident: every session stays in GPU memory between turns (the baseline: its host tier rescues
  only idle sessions, and an agent's conversation is never idle). The most agents is
  cards x (usable KV tokens per card // mean conversation).
- active: ikcode's host tier takes the sessions between turns and reloads them over PCIe, so only
  turns in flight need GPU memory, each once (the adapter copies a GPU-tier hit into the
  sequence's own blocks and unpins the cached copy at once). The most agents is the turns that
  fit at once divided by the share of its time an agent has a turn in flight, with the engine's
  prefill vote as ikcode's DeepInfer adapter sets it (`engine_schedule`).
- compute: every turn reads its new tokens, and every conversation starts with a cold read of
  its whole context, which over its steps is context / steps per turn; the cards read at most the
  no-cache rate all together. The most agents is that rate over one agent's read rate.
The most agents at this size is the lower of the two that apply to ikcode (active, compute). Past
it, turns wait: a closed system of N agents on K turn slots of S seconds each answers in
N x S / K - think time (the asymptotic bound), and N agents reading R tokens per cycle each from a
server reading C per second cycle in no less than N x R / C; `plan` prints the larger wait.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from ikcode.bench.hardware import HardwareModel

VERDICT = "size the GPU tier for sessions active at once"


@dataclass(frozen=True)
class PlanLoad:
    """How an agent spends its time (defaults: the bench's agents, lognormal sigma 1)."""

    output_tokens: float = 200 * math.exp(0.5)  # mean of a lognormal with median 200
    tokens_per_step: float = 2000 * math.exp(0.5)
    tool_pause_s: float = 4.0 * math.exp(0.5)
    steps_per_conversation: int = 32
    block_size: int = 2048


def mean_conversation_tokens(context_tokens: int, load: PlanLoad) -> float:
    """A conversation's mean size over its life: it starts at context_tokens and grows each step."""
    growth = (load.steps_per_conversation - 1) / 2 * (load.tokens_per_step + load.output_tokens)
    return context_tokens + growth + load.output_tokens


def plan(
    hw: HardwareModel,
    context_tokens: int,
    agents: int,
    load: PlanLoad | None = None,
    engine_schedule: dict[str, int] | None = None,
) -> dict[str, Any]:
    if context_tokens < 1 or agents < 0:
        raise ValueError(f"need context_tokens >= 1 and agents >= 0, got {context_tokens} and {agents}")
    load = load or PlanLoad()
    live = replace(hw, **engine_schedule) if engine_schedule else hw  # the engine as ikcode runs it
    conv = mean_conversation_tokens(context_tokens, load)
    usable = hw.kv_tokens_per_card * hw.prefill_watermark  # allocation keeps the rest for decode
    resident_per_card = int(usable // conv)
    max_resident = hw.cards * resident_per_card
    slots_per_card = int(usable // conv)  # a turn holds its conversation once
    slots = hw.cards * slots_per_card
    # One turn in flight: the wait for the engine's prefill vote (about one attempt interval of
    # decode steps), its new tokens' prefill, then the answer's decode steps.
    step_s = hw.decode_step_seconds(max(1, slots_per_card) * int(conv))
    vote_s = live.prefill_attempt_interval * step_s
    prefill_s = hw.prefill_seconds(int(load.tokens_per_step + load.block_size / 2))
    decode_s = load.output_tokens * step_s
    turn_s = vote_s + prefill_s + decode_s
    cycle_s = turn_s + load.tool_pause_s
    duty = turn_s / cycle_s
    max_memory = int(slots / duty) if duty > 0 else slots
    # Compute: an agent's reads per cycle (its new tokens, and its share of the conversation's
    # cold read) against what the cards read together.
    read_per_turn = context_tokens / load.steps_per_conversation + load.tokens_per_step + load.output_tokens
    read_rate = hw.cold_read_tokens_per_s()
    max_compute = int(read_rate * cycle_s / read_per_turn)
    max_active = min(max_memory, max_compute)
    limit = "GPU memory" if max_memory <= max_compute else "compute"
    active = agents * duty
    # Past the limit turns queue: the closed-system bounds on the time to answer.
    memory_wait_s = agents * turn_s / max(1, slots) - cycle_s
    compute_wait_s = agents * read_per_turn / read_rate - cycle_s
    wait_s = max(0.0, memory_wait_s, compute_wait_s)
    fits = agents <= max_active
    if fits:
        status = (
            f"{agents} agents fit: ~{active:.0f} turns in flight of {slots} that fit on the GPUs, "
            f"{agents * read_per_turn / cycle_s / 1e3:,.0f}K of {read_rate / 1e3:,.0f}K tokens/s read"
        )
    else:
        status = (
            f"{agents} agents do not fit ({limit} is the limit): {agents - max_active} agents too many; "
            f"at most {max_active} agents of this size, past that each turn waits ~{wait_s:.0f} s"
        )
    return {
        "hardware": hw.name,
        "context_tokens": context_tokens,
        "agents": agents,
        "mean_conversation_tokens": round(conv),
        "kv_bytes_per_token": hw.kv_bytes_per_token,
        "kv_tokens_per_card": hw.kv_tokens_per_card,
        "usable_kv_tokens_per_card": int(usable),
        "conversation_bytes": int(conv * hw.kv_bytes_per_token),
        "gpu_tier_tokens": hw.kv_tokens_per_card * hw.cards,
        "host_tier_tokens": hw.host_tier_tokens,
        "conversations_on_gpu": max_resident,
        "conversations_in_host": int(hw.host_tier_tokens // conv),
        "max_agents_resident": max_resident,
        "turn_slots": slots,
        "turn_s": turn_s,
        "agent_busy_share": duty,
        "active_at_once": active,
        "max_agents_at_this_size": max_active,
        "max_agents_memory": max_memory,
        "max_agents_compute": max_compute,
        "read_tokens_per_turn": round(read_per_turn),
        "limit": limit,
        "fits": fits,
        "over_by_agents": max(0, agents - max_active),
        "predicted_wait_s": wait_s,
        "cold_read_s": hw.prefill_seconds(context_tokens),
        "reload_s": hw.copy_seconds(context_tokens),
        "no_cache_read_tokens_per_s": hw.cold_read_tokens_per_s(),
        "status": status,
        "verdict": VERDICT,
    }


def session_limit(
    hw: HardwareModel, engine_schedule: dict[str, int] | None = None, load: PlanLoad | None = None
) -> Callable[[int], int]:
    """Admission's limit on sessions active at once: plan's most agents at a conversation size
    (its tokens at the first turn), the number `ikcode plan` prints for it."""

    @lru_cache(maxsize=1024)
    def at(context_thousands: int) -> int:
        result = plan(hw, max(1, context_thousands * 1000), 0, load, engine_schedule)
        return int(result["max_agents_at_this_size"])

    # Sizes 1,000 tokens apart give the same limit to within an agent; the cache keeps it cheap.
    return lambda context_tokens: at(round(context_tokens / 1000))


def simulate_limit(
    hw: HardwareModel,
    context_tokens: int,
    limit: int,
    admission: Any,
    block_size: int = 2048,
    engine_schedule: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """The simulator at plan's limit, 10% under it and 25% past it: where turns start waiting."""
    from ikcode.bench.simulate import run_simulation
    from ikcode.bench.workload import AgentsWorkload

    rows = []
    for agents in sorted({max(1, int(limit * 0.9)), limit, int(limit * 1.25)}):
        report = run_simulation(
            hw,
            admission,
            AgentsWorkload(agents=agents, context_tokens=context_tokens),
            block_size,
            engine_schedule=engine_schedule,
        )
        rows.append(
            {
                "agents": agents,
                "policy": admission.policy,
                "p50": report["ttft"]["p50"],
                "p95": report["ttft"]["p95"],
                "cached_token_share": report["cached_token_share"],
                "failed": report["failed"],
                # New sessions that waited for a slot: admission holds the sessions at plan's limit.
                "sessions_waited": report["admission"].get("sessions_waited", 0),
            }
        )
    return rows
