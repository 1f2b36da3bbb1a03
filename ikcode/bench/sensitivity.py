"""The sensitivity table: how the simulated results move with the run's shape and each figure.

Rows: the base run; the ramp (agents joining over 30-300 s); the run length (375-1500 s); and
each derived hardware figure at -20% and +20%. Every row runs both admission policies on the
same workload. The start-up floor beside each row is physics, not simulation: one card reading
its share of the agents' first conversations from zero, which no admission order can shorten.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ikcode.admission import AdmissionConfig

from .hardware import DERIVED_FIGURES, HardwareModel
from .simulate import run_simulation
from .workload import AgentsWorkload

RAMPS_S = (300.0,)
DURATIONS_S = (375.0, 1500.0)
FACTORS = (0.8, 1.2)


def sensitivity_rows(
    hardware: HardwareModel,
    admissions: list[AdmissionConfig],
    workload: AgentsWorkload,
    block_size: int = 2048,
    cache_policy: str = "lru",
    engine_schedule: Mapping[str, int] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    cases: list[tuple[str, HardwareModel, AgentsWorkload]] = [("base", hardware, workload)]
    cases += [(f"ramp {r:.0f} s", hardware, replace(workload, ramp_s=r)) for r in RAMPS_S]
    cases += [(f"run {d:.0f} s", hardware, replace(workload, duration_s=d)) for d in DURATIONS_S]
    for figure in DERIVED_FIGURES:
        for factor in FACTORS:
            cases.append((f"{figure} x{factor:g}", hardware.scaled(figure, factor), workload))
    rows: list[dict[str, Any]] = []
    for label, hw, w in cases:
        if progress is not None:
            progress(label)
        row: dict[str, Any] = {"row": label, "startup_floor_s": startup_floor_s(hw, w), "policies": {}}
        for admission in admissions:
            report = run_simulation(
                hw, admission, w, block_size, cache_policy, engine_schedule=engine_schedule
            )
            row["policies"][admission.policy] = _summary(report)
        rows.append(row)
    return rows


def startup_floor_s(hw: HardwareModel, workload: AgentsWorkload) -> float:
    """One card reading its share of the first conversations from zero."""
    per_card = -(-workload.agents // hw.cards)
    return hw.prefill_seconds(per_card * workload.context_tokens)


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    ttft, steady = report["ttft"], report["steady"]["ttft"]
    return {
        "p50": ttft["p50"],
        "p95": ttft["p95"],
        "cold_p50": ttft["cold"]["p50"],
        "cold_p95": ttft["cold"]["p95"],
        "steady_n": steady["n"],
        "steady_p50": steady["p50"],
        "steady_p95": steady["p95"],
        "cached_token_share": report["cached_token_share"],
        "failed": report["failed"],
    }


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A Markdown table, one line per row and policy."""
    lines = [
        "| row | policy | p50 | p95 | steady p50 | steady p95 (n) | cold p50 / p95 | cached | failed "
        "| start-up floor |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        for policy, s in row["policies"].items():
            lines.append(
                f"| {row['row']} | {policy} | {s['p50']:.2f} | {s['p95']:.1f} | {s['steady_p50']:.2f} | "
                f"{s['steady_p95']:.1f} ({s['steady_n']}) | {s['cold_p50']:.0f} / {s['cold_p95']:.0f} | "
                f"{s['cached_token_share']:.1%} | {s['failed']} | {row['startup_floor_s']:.0f} s |"
            )
    return "\n".join(lines)
