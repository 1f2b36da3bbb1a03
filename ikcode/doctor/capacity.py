"""Capacity: how full the cache tiers are now, and what `ikcode plan` says about active sessions."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ikcode.doctor.context import DoctorContext
from ikcode.doctor.result import CheckResult, passed, warned

NAME = "capacity"
GAUGES = (
    "kv_blocks_total",
    "kv_blocks_used",
    "kv_blocks_cached",
    "host_blocks_total",
    "host_blocks_used",
    "running",
    "waiting",
)

RANK_GAUGE = "ikcode_engine_rank_kv_blocks_total"


def _samples(text: str) -> list[Any]:
    """Every sample of a Prometheus text exposition (prometheus_client's own parser)."""
    try:
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    except ValueError:  # not the exposition format: nothing read
        return []


def unlabelled(samples: list[Any]) -> dict[str, float]:
    """Unlabelled samples by name."""
    return {sample.name: sample.value for sample in samples if not sample.labels}


def rank_blocks(samples: list[Any]) -> list[float]:
    """ikcode_engine_rank_kv_blocks_total by rank, in rank order (empty: not exported)."""
    ranks = {int(s.labels["rank"]): s.value for s in samples if s.name == RANK_GAUGE and "rank" in s.labels}
    return [ranks[r] for r in sorted(ranks)]


def _plan_summary(ctx: DoctorContext) -> dict[str, Any] | None:
    if not ctx.profile.hardware:
        return None
    from ikcode.bench.hardware import HardwareModel, adapter_schedule
    from ikcode.plan import plan

    try:
        hw = HardwareModel.from_dict(ctx.profile.hardware, name=ctx.profile.name)
        schedule = adapter_schedule(ctx.profile)
    except ValueError:
        return None
    context = min(ctx.context_window or ctx.profile.context_window, 450_000)
    result = plan(hw, context, agents=100, engine_schedule=schedule)
    keys = (
        "context_tokens",
        "agents",
        "conversations_on_gpu",
        "conversations_in_host",
        "active_at_once",
        "fits",
        "max_agents_at_this_size",
        "limit",
        "status",
    )
    return {k: result[k] for k in keys}


def check_capacity(ctx: DoctorContext) -> CheckResult:
    response = ctx.client.get("/metrics")
    samples = _samples(response.text) if response.status_code == 200 else []
    metrics = unlabelled(samples)
    engine = {k: metrics.get(f"ikcode_engine_{k}") for k in GAUGES}
    planned = _plan_summary(ctx)
    data: dict[str, Any] = {"engine": engine, "plan": planned}
    if engine["kv_blocks_total"] is None:
        detail = "the server exports no engine gauges at /metrics"
        if planned:
            detail += f"; plan: {planned['status']}"
        return warned(NAME, detail, "read the engine's own cache statistics", **data)
    total, used = engine["kv_blocks_total"] or 0, engine["kv_blocks_used"] or 0
    cached = engine["kv_blocks_cached"] or 0
    parts = [f"device tier {used:.0f}/{total:.0f} blocks in use, {cached:.0f} cached"]
    if engine["host_blocks_total"]:
        parts.append(
            f"host tier {engine['host_blocks_used'] or 0:.0f}/{engine['host_blocks_total']:.0f} blocks"
        )
    block = ctx.health.get("block_size") or 16
    window = ctx.context_window or ctx.profile.context_window
    # A conversation's KV lives on one rank: count whole windows rank by rank (two ranks of 0.6
    # windows each hold none, not 1.2).
    ranks = rank_blocks(samples)
    per_rank = [blocks * block / window if window else 0 for blocks in (ranks or [total])]
    fits = sum(int(w) for w in per_rank) if len(per_rank) > 1 else per_rank[0]
    data["window_conversations_on_device"] = round(fits, 2)
    data["rank_windows"] = [round(w, 2) for w in per_rank]
    parts.append(f"~{fits:.1f} full-window conversations fit on the device tier")
    if len(per_rank) > 1:
        parts[-1] += f" ({len(per_rank)} ranks of {min(per_rank):.1f}-{max(per_rank):.1f} windows each)"
    if planned:
        parts.append(
            f"plan ({planned['agents']} agents of {planned['context_tokens']:,} tokens): {planned['status']}"
        )
    detail = "; ".join(parts)
    if max(per_rank) < 1:
        return warned(
            NAME,
            detail,
            "raise the KV budget (profile [model] kv_cache_mb): one conversation of the "
            "full window does not fit the cache" + (" of a rank" if len(per_rank) > 1 else ""),
            **data,
        )
    if total and used >= total and (engine["waiting"] or 0) > 0:
        return warned(
            NAME,
            detail + "; requests wait for KV memory",
            "size the device tier for the sessions active at once (`ikcode plan`)",
            **data,
        )
    return passed(NAME, detail, **data)
