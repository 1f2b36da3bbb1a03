"""The installed Claude Code: on PATH (or IKCODE_CLAUDE_BIN), and recent enough.

Before 2.1.181 the attribution line in the system prompt changed on every request, so no prefix
cache could hold a conversation whatever the server did.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from ikcode.doctor.context import DoctorContext
from ikcode.doctor.result import CheckResult, passed, warned
from ikcode.launcher.claude import NPM_HINT, TESTED_CLAUDE_VERSION

NAME = "claude"
MIN_VERSION = (2, 1, 181)
_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)")
# By its exact version: asked for without one, npm picks an older release on an older Node.
UPGRADE = "upgrade: npm install -g @anthropic-ai/claude-code@$(npm view @anthropic-ai/claude-code version)"


def find_claude_bin(environ: dict[str, str]) -> str | None:
    explicit = environ.get("IKCODE_CLAUDE_BIN")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("claude", path=environ.get("PATH"))


def check_claude(ctx: DoctorContext) -> CheckResult:
    binary = find_claude_bin(ctx.environ)
    if binary is None:
        where = ctx.environ.get("IKCODE_CLAUDE_BIN")
        detail = f"IKCODE_CLAUDE_BIN={where} is not executable" if where else "`claude` is not on PATH"
        return warned(NAME, detail, f"install Claude Code: {NPM_HINT}")
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=30, env=ctx.environ
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return warned(
            NAME, f"{binary} --version failed: {err}", f"reinstall Claude Code: {NPM_HINT}", path=binary
        )
    match = _VERSION.search(out.stdout or "")
    if out.returncode != 0 or match is None:
        return warned(
            NAME, f"{binary} --version printed no version", f"reinstall Claude Code: {NPM_HINT}", path=binary
        )
    version = tuple(int(part) for part in match.groups())
    text = ".".join(map(str, version))
    problem = None
    if version < MIN_VERSION:
        problem = f"before {'.'.join(map(str, MIN_VERSION))} its attribution line changes every request"
    elif version < TESTED_CLAUDE_VERSION:
        tested = ".".join(map(str, TESTED_CLAUDE_VERSION))
        problem = f"older than {tested}, the release ikcode is tested with"
    if problem is not None:
        return warned(NAME, f"Claude Code {text} at {binary}: {problem}", UPGRADE, path=binary, version=text)
    return passed(NAME, f"Claude Code {text} at {binary}", path=binary, version=text)
