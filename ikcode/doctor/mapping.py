"""Role mapping as the client will see it: every role names the served model, and no settings
file or shell variable overrides what ikcode gives claude; no conflicting credentials."""

from __future__ import annotations

from ikcode.doctor.context import DoctorContext
from ikcode.doctor.result import CheckResult, failed, passed, warned
from ikcode.launcher import settings as claude_settings
from ikcode.launcher.claude import mapping_for
from ikcode.launcher.rolemap import CONFLICTING_VARS, ENDPOINT_VARS, FIXED_VARS, MODEL_ROLE_VARS

NAME = "mapping"
# A wrong value here sends requests to the wrong model or endpoint, or defeats the prefix cache.
CRITICAL = (
    set(MODEL_ROLE_VARS) | set(ENDPOINT_VARS) | set(CONFLICTING_VARS) | {"CLAUDE_CODE_ATTRIBUTION_HEADER"}
)
SOURCE_NAMES = {
    "managed": "managed settings",
    "local": "project local settings",
    "project": "project settings",
    "user": "user settings",
    "shell": "the shell",
}


def check_mapping(ctx: DoctorContext) -> CheckResult:
    mapping = mapping_for(ctx.profile, ctx.base_url, discover=ctx.reachable)
    served = mapping.set["ANTHROPIC_MODEL"]
    files = claude_settings.settings_files(ctx.project_dir)
    try:
        for path in files.values():
            claude_settings.read_settings(path)
    except claude_settings.SettingsError as err:
        return failed(NAME, str(err), "fix the JSON of that settings file; Claude Code ignores a broken one")
    reports = claude_settings.resolve(mapping, ctx.project_dir, ctx.environ)
    fails: list[str] = []
    warns: list[str] = []
    fixes: list[str] = []
    for report in reports:
        if report.status != "conflict":
            continue
        source = report.winner or "shell"
        where = str(files[source]) if source in files else "the shell"
        value = claude_settings.redact_value(report.name, report.effective)
        wanted = claude_settings.redact_value(report.name, report.expected) or "(unset)"
        line = f"{report.name}={value!s} from {SOURCE_NAMES[source]} ({where}) overrides {wanted}"
        critical = report.name in CRITICAL
        if source == "shell":
            # `ikcode claude` replaces the shell's value in the child; only hand-run claude sees it.
            warns.append(line)
            fixes.append(f'unset {report.name} in your shell (or `eval "$(ikcode env)"`)')
        elif critical or source == "managed":
            fails.append(line)
            fixes.append(f"remove {report.name} from the env block of {where} (or `ikcode settings --write`)")
        else:
            warns.append(line)
            fixes.append(f"remove {report.name} from the env block of {where}")
    data = {
        "served_model": served,
        "roles": {name: mapping.set[name] for name in MODEL_ROLE_VARS},
        "conflicts": [r.name for r in reports if r.status == "conflict"],
        "attribution_header": FIXED_VARS["CLAUDE_CODE_ATTRIBUTION_HEADER"],
    }
    if fails:
        return failed(NAME, "; ".join(fails), "; ".join(dict.fromkeys(fixes)), **data)
    if warns:
        return warned(NAME, "; ".join(warns), "; ".join(dict.fromkeys(fixes)), **data)
    return passed(
        NAME,
        f"all {len(MODEL_ROLE_VARS)} model roles map to {served}; no settings file overrides them",
        **data,
    )
