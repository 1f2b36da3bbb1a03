"""`ikcode doctor`: prove the stack is healthy and that its prefix cache really hits."""

from ikcode.doctor.context import FULL, QUICK, DoctorContext
from ikcode.doctor.result import FAIL, PASS, SKIP, WARN, CheckResult
from ikcode.doctor.runner import CHECKS, NAMES, report, run_checks

__all__ = [
    "CHECKS", "FAIL", "FULL", "NAMES", "PASS", "QUICK", "SKIP", "WARN",
    "CheckResult", "DoctorContext", "report", "run_checks",
]  # fmt: skip
