"""Run the checks in order; those that need the endpoint are skipped when it does not answer."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ikcode.doctor.capacity import check_capacity
from ikcode.doctor.claude_version import check_claude
from ikcode.doctor.context import DoctorContext
from ikcode.doctor.contract import check_contract
from ikcode.doctor.endpoint import check_endpoint
from ikcode.doctor.mapping import check_mapping
from ikcode.doctor.quality_gate import check_quality_gate
from ikcode.doctor.result import FAIL, SKIP, CheckResult, failed
from ikcode.doctor.silent_miss import check_silent_miss
from ikcode.doctor.tail import check_tail

Check = Callable[[DoctorContext], CheckResult]
# (name, check, needs a reachable endpoint). The silent-miss and tail checks come after the quality
# gate so that they see its cold/warm pair in the log.
CHECKS: list[tuple[str, Check, bool]] = [
    ("endpoint", check_endpoint, False),
    ("contract", check_contract, True),
    ("mapping", check_mapping, False),
    ("claude", check_claude, False),
    ("quality_gate", check_quality_gate, True),
    ("silent_miss", check_silent_miss, False),
    ("tail", check_tail, False),
    ("capacity", check_capacity, True),
]
NAMES = [name for name, _, _ in CHECKS]


def run_checks(ctx: DoctorContext, only: list[str] | None = None) -> list[CheckResult]:
    results: list[CheckResult] = []
    try:
        for name, check, needs_endpoint in CHECKS:
            if only is not None and name not in only and name != "endpoint":
                continue
            if needs_endpoint and not ctx.reachable:
                results.append(CheckResult(name, SKIP, "not run: the endpoint does not answer", ""))
                continue
            started = time.monotonic()
            try:
                result = check(ctx)
            except Exception as err:  # a check that breaks is a failure to report, not a crash
                result = failed(
                    name,
                    f"the check itself failed: {type(err).__name__}: {err}",
                    "report this with `ikcode doctor --json` output",
                )
            result.data.setdefault("seconds", round(time.monotonic() - started, 3))
            results.append(result)
    finally:
        ctx.close()
    return results


def report(results: list[CheckResult], **extra: Any) -> dict[str, Any]:
    """The JSON document `ikcode doctor --json` prints."""
    return {"ok": all(r.status != FAIL for r in results), **extra, "checks": [r.to_dict() for r in results]}
