"""Tail: TTFT median and p95 over the recent log, split warm/cold, against the profile's bound.

The published run had a 2.55 s median and a 37 s p95: a median hides the turns that queue.
Warm turns (conversation cached) should start fast whatever cold work is queued.
"""

from __future__ import annotations

from typing import Any

from ikcode.doctor.context import DoctorContext
from ikcode.doctor.request_log import no_log_result, read_records, this_run
from ikcode.doctor.result import CheckResult, failed, passed, warned

NAME = "tail"
RECENT = 2000
MIN_SAMPLES = 5  # fewer: report, do not judge a p95
WARM_HIT_RATE = 0.5  # as the gateway's metrics label a request
GAVE_UP = "client disconnected"  # the request log's error for a client that left (gateway, front)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))
    return ordered[index]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    groups: dict[str, list[float]] = {"warm": [], "cold": []}
    gave_up: dict[str, int] = {}
    for record in records[-RECENT:]:
        kind = record.get("cache_class") or (
            "warm" if float(record.get("hit_rate") or 0) >= WARM_HIT_RATE else "cold"
        )
        if record.get("ttft_ms") is not None:  # a first token went out (whatever came after)
            groups.setdefault(kind, []).append(float(record["ttft_ms"]) / 1000)
        elif record.get("error") == GAVE_UP and record.get("duration_ms") is not None:
            # The client left before a first token: the slowest turns of all. It waited at least
            # this long, so it counts as that (a lower bound) rather than leaving the tail.
            groups.setdefault(kind, []).append(float(record["duration_ms"]) / 1000)
            gave_up[kind] = gave_up.get(kind, 0) + 1
    out: dict[str, Any] = {}
    for kind, values in groups.items():
        out[kind] = {"count": len(values), "gave_up": gave_up.get(kind, 0)}
        if values:
            out[kind].update(
                p50_s=round(percentile(values, 0.5), 3), p95_s=round(percentile(values, 0.95), 3)
            )
    return out


def check_tail(ctx: DoctorContext) -> CheckResult:
    records = read_records(ctx.request_log)
    if records is None:
        return no_log_result(ctx, NAME, "summarize TTFT")
    records = this_run(records, (ctx.health or {}).get("started_at"))  # as silent_miss reads them
    bound = ctx.ttft_bound_s
    summary = summarize(records)
    data = {"ttft_bound_s": bound, **summary}
    parts = [
        f"{kind} p50 {s['p50_s']:.2f} s / p95 {s['p95_s']:.2f} s (n={s['count']}"
        + (f", {s['gave_up']} left before a first token" if s["gave_up"] else "")
        + ")"
        for kind, s in summary.items() if s["count"]
    ]  # fmt: skip
    if not parts:
        return warned(
            NAME, "no answered requests in the log yet", "run some turns, then doctor again", **data
        )
    detail = "; ".join(parts) + f"; target {bound:g} s"
    warm, cold = summary.get("warm", {}), summary.get("cold", {})
    fix = (
        "let cached turns go first and cap concurrent cold prefills ([admission] in the profile); "
        "see `ikcode bench`"
    )
    if warm.get("count", 0) >= MIN_SAMPLES and warm["p95_s"] > bound:
        return failed(NAME, "warm turns queue: " + detail, fix, **data)
    if cold.get("count", 0) >= MIN_SAMPLES and cold["p95_s"] > bound:
        return warned(
            NAME,
            "cold turns exceed the target: " + detail,
            "more prefill capacity or fewer fresh sessions at once; " + fix,
            **data,
        )
    if max(warm.get("count", 0), cold.get("count", 0)) < MIN_SAMPLES:
        return passed(NAME, detail + " (few samples)", **data)
    return passed(NAME, detail, **data)
