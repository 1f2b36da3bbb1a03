"""One check's verdict: pass / warn / fail (or skip), a one-line detail, the fix, and numbers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"


@dataclass
class CheckResult:
    name: str
    status: str  # PASS, WARN, FAIL or SKIP (not run: an earlier check it needs failed)
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "detail": self.detail,
            "fix": self.fix,
            "data": self.data,
        }


def passed(name: str, detail: str, **data: Any) -> CheckResult:
    return CheckResult(name, PASS, detail, "", data)


def warned(name: str, detail: str, fix: str, **data: Any) -> CheckResult:
    return CheckResult(name, WARN, detail, fix, data)


def failed(name: str, detail: str, fix: str, **data: Any) -> CheckResult:
    return CheckResult(name, FAIL, detail, fix, data)
