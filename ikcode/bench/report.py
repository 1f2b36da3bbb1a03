"""Printing the bench report (rich table) and writing it (JSON)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def print_reports(reports: list[dict[str, Any]], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="ikcode bench: time to first token (s)")
    for col in ("policy", "turns", "class", "n", "p50", "p95", "p99"):
        table.add_column(col, justify="right" if col not in ("policy", "class") else "left")
    for r in reports:
        policy = str(r["config"].get("policy", "-"))
        for cls in ("all", "warm", "cold"):
            block = r["ttft"] if cls == "all" else r["ttft"][cls]
            table.add_row(
                policy if cls == "all" else "",
                str(r["requests"]) if cls == "all" else "",
                cls,
                str(block["n"]),
                *(_seconds(block, p) for p in ("p50", "p95", "p99")),
            )
    console.print(table)
    summary = Table(title="load and cache")
    cols = ("policy", "failed", "retried", "within 15 s", "from cache", "read tok/s", "computed tok/s")
    for col in cols:
        summary.add_column(col, justify="right")
    for r in reports:
        summary.add_row(
            str(r["config"].get("policy", "-")),
            str(r["failed"]),
            str(r["shed_retries"]),
            f"{r['share_within_15s']:.1%}",
            f"{r['cached_token_share']:.1%}",
            f"{r['read_tokens_per_s']:,.0f}",
            f"{r['computed_tokens_per_s']:,.0f}",
        )
    console.print(summary)
    for r in reports:
        for error, count in (r.get("errors") or {}).items():
            policy = r["config"].get("policy", "-")
            console.print(f"[yellow]{policy}: {count} turn(s) failed: {error}[/yellow]", highlight=False)
    if any("steady" in r for r in reports):
        steady = Table(title="steady state (turns sent after every agent's first turn finished) vs start-up")
        for col in ("policy", "section", "from (s)", "n", "p50", "p95", "cold n", "cold p50", "cold p95"):
            steady.add_column(col, justify="left" if col in ("policy", "section") else "right")
        for r in reports:
            since = r["steady"]["from_s"]
            for name, block in (("steady", r["steady"]["ttft"]), ("start-up", r["startup"]["ttft"])):
                steady.add_row(
                    str(r["config"].get("policy", "-")) if name == "steady" else "",
                    name,
                    f"{since:.0f}" if since is not None and name == "steady" else "",
                    str(block["n"]),
                    _seconds(block, "p50"),
                    _seconds(block, "p95"),
                    str(block["cold"]["n"]),
                    _seconds(block["cold"], "p50", 1),
                    _seconds(block["cold"], "p95", 1),
                )
        console.print(steady)
    for r in reports:
        if "no_cache_read_tokens_per_s" in r:
            from .published import comparisons

            policy = r["config"].get("policy")
            for line in comparisons(r):
                console.print(f"[dim]{policy}: {line}[/dim]")
            console.print(f"[dim]{policy}: simulated in {r['simulator']['wall_s']:.1f} s[/dim]")


def _seconds(block: dict[str, Any], key: str, digits: int = 2) -> str:
    """A percentile of a TTFT block; a dash where no turn of the class finished (the JSON's 0.0
    there would read as instant)."""
    return f"{block[key]:.{digits}f}" if block.get("n", 1) else "-"


def write_json(reports: list[dict[str, Any]], path: str | Path) -> None:
    """One policy: the report itself. Several: {"runs": [report, ...]} in the order given."""
    data: dict[str, Any] = reports[0] if len(reports) == 1 else {"runs": reports}
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
