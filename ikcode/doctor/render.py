"""The doctor's table for people (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ikcode.doctor.result import FAIL, PASS, SKIP, WARN, CheckResult

STYLE = {PASS: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


def render_table(results: list[CheckResult], console: Console, title: str) -> None:
    table = Table(title=title, show_lines=True, expand=True)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", ratio=3)
    table.add_column("fix", ratio=2)
    for result in results:
        style = STYLE.get(result.status, "")
        table.add_row(result.name, f"[{style}]{result.status}[/{style}]", result.detail, result.fix)
    console.print(table)
    failed = [r.name for r in results if r.status == FAIL]
    if failed:
        console.print(f"[bold red]failed:[/bold red] {', '.join(failed)}")
    else:
        console.print("[green]no check failed[/green]")
