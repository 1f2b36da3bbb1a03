"""Claude Code's settings files, their `env` blocks, and which source wins for each variable.

A settings file's `env` block beats the shell, and the files layer as: managed policy >
`--settings` on the command line > project local > project shared > user. A stale
`ANTHROPIC_MODEL` in any of them silently overrides what a user exported.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ikcode import paths
from ikcode.auth import TOKEN_PREFIX
from ikcode.launcher.rolemap import Mapping
from ikcode.launcher.statusline import statusline_setting

SECRET_VARS = ("ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_API_KEY")


class SettingsError(Exception):
    pass


def claude_config_dir() -> Path:
    return Path(os.environ.get("CLAUDE_CONFIG_DIR") or Path.home() / ".claude")


def settings_files(project_dir: Path) -> dict[str, Path]:
    """Every settings file Claude Code reads, highest precedence first."""
    return {
        "managed": Path("/etc/claude-code/managed-settings.json"),
        "local": project_dir / ".claude" / "settings.local.json",
        "project": project_dir / ".claude" / "settings.json",
        "user": claude_config_dir() / "settings.json",
    }


def scope_path(scope: str, project_dir: Path) -> Path:
    if scope == "project":
        return settings_files(project_dir)["local"]
    if scope == "user":
        return settings_files(project_dir)["user"]
    raise SettingsError(f"unknown scope {scope!r}; choose project or user")


def read_settings(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8") or "{}")
    except json.JSONDecodeError as err:
        raise SettingsError(f"{path} is not valid JSON ({err}); fix or move it first") from None
    if not isinstance(data, dict):
        raise SettingsError(f"{path} must hold a JSON object")
    env = data.get("env", {})
    if not isinstance(env, dict):
        raise SettingsError(f"{path}: 'env' must be an object, got {type(env).__name__}")
    return data


def backups_dir() -> Path:
    """Where a settings file's backups go: ikcode's own state dir, not beside the file. A
    project's .claude/ is inside its repository, where git ignores settings.local.json but would
    not ignore a copy of it (and the user's own keys in it)."""
    return paths.state_dir() / "settings-backups"


def _write(path: Path, data: dict, before: dict) -> Path | None:
    """Write atomically with mode 0600 (the env block carries a token); return the backup path.
    `before` is the file as read. The new file starts as a temp file of a fresh name (mkstemp:
    created, never opened through a link or a leftover of another mode) and replaces the old."""
    path.parent.mkdir(parents=True, exist_ok=True)
    backup = _back_up(path, before) if path.exists() else None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(_json(data))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return backup


def _back_up(path: Path, before: dict) -> Path:
    """A mode-0600 copy of path under backups_dir(), less ikcode's own token (what the user had is
    kept; a token is not left behind where the user removed it). A new file each time: a second
    write within the same second gets the next number instead of replacing the first backup."""
    env = before.get("env", {})
    ours = [name for name in SECRET_VARS if str(env.get(name, "")).startswith(TOKEN_PREFIX)]
    if ours:
        content = _json({**before, "env": {k: v for k, v in env.items() if k not in ours}}).encode()
    else:
        content = path.read_bytes()
    folder = paths.ensure(backups_dir())
    where = hashlib.blake2b(str(path.resolve()).encode(), digest_size=4).hexdigest()
    name = f"{path.parent.parent.name or 'root'}-{path.name}-{where}.bak-{time.strftime('%Y%m%d-%H%M%S')}"
    for serial in itertools.count(1):
        backup = folder / (name if serial == 1 else f"{name}-{serial}")
        try:
            fd = os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
        return backup
    raise AssertionError("unreachable")


def _json(data: dict) -> str:
    return json.dumps(data, indent=2) + "\n"


def write_env_block(
    path: Path, mapping: Mapping, statusline_command: str | None = None
) -> tuple[Path | None, list[str]]:
    """Merge the mapping into path's env block, keeping every other key. Returns (backup, removed).

    With a statusline_command, Claude Code's `statusLine` runs it (replacing the file's own)."""
    before = read_settings(path)
    data = dict(before)
    env = dict(data.get("env", {}))
    removed = [name for name in mapping.unset if name in env]
    for name in removed:
        del env[name]
    env.update(mapping.set)
    data["env"] = env
    if mapping.model_overrides:
        overrides = data.get("modelOverrides")
        data["modelOverrides"] = {
            **(overrides if isinstance(overrides, dict) else {}),
            **mapping.model_overrides,
        }
    if statusline_command:
        data["statusLine"] = statusline_setting(statusline_command)
    return _write(path, data, before), removed


def remove_env_block(
    path: Path, names: tuple[str, ...], model_overrides: dict[str, str] | None = None
) -> tuple[Path | None, list[str]]:
    """Take the mapping's variables (and the model overrides it wrote) out of path again."""
    before = read_settings(path)
    data = dict(before)
    env = dict(data.get("env", {}))
    removed = [name for name in names if name in env]
    overrides = data.get("modelOverrides")
    ours = [
        key
        for key, value in (model_overrides or {}).items()
        if isinstance(overrides, dict) and overrides.get(key) == value
    ]
    if not removed and not ours:
        return None, []
    for name in removed:
        del env[name]
    if env:
        data["env"] = env
    else:
        data.pop("env", None)
    if ours:
        kept = {k: v for k, v in overrides.items() if k not in ours}
        if kept:
            data["modelOverrides"] = kept
        else:
            data.pop("modelOverrides", None)
    return _write(path, data, before), removed + [f"modelOverrides.{key}" for key in ours]


@dataclass(frozen=True)
class VariableReport:
    name: str
    expected: str | None  # None = should be absent
    values: dict[str, str | None]  # source -> value ("shell", "user", "project", "local", "managed")
    winner: str | None  # the source whose value the client will use
    status: str  # "ok", "conflict", "missing"

    @property
    def effective(self) -> str | None:
        return self.values.get(self.winner) if self.winner else None


def resolve(mapping: Mapping, project_dir: Path, environ: dict[str, str]) -> list[VariableReport]:
    """For each variable of the mapping: every source's value, the winner, and whether it fights."""
    files = settings_files(project_dir)
    envs: dict[str, dict] = {}
    for source, path in files.items():
        try:
            envs[source] = read_settings(path).get("env", {})
        except SettingsError:
            envs[source] = {}
    order = ["managed", "local", "project", "user", "shell"]
    reports = []
    for name in mapping.names:
        expected = mapping.set.get(name)
        values: dict[str, str | None] = {s: (envs[s].get(name) if s in envs else None) for s in order[:-1]}
        values["shell"] = environ.get(name)
        winner = next((s for s in order if values.get(s) is not None), None)
        effective = values.get(winner) if winner else None
        if expected is None:
            status = "ok" if effective is None else "conflict"
        elif effective is None:
            status = "missing"
        else:
            status = "ok" if str(effective) == expected else "conflict"
        reports.append(VariableReport(name, expected, values, winner, status))
    return reports


def redact_value(name: str, value: str | None) -> str | None:
    if value is None or name not in SECRET_VARS:
        return value
    return value[:5] + "…" if len(value) > 8 else "…"
