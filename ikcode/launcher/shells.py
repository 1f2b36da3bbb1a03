"""Render a Mapping as commands for a shell, so that `eval "$(ikcode env)"` works in each."""

from __future__ import annotations

import json
import shlex

from ikcode.launcher.rolemap import Mapping

SHELLS = ("bash", "zsh", "fish", "powershell", "json")


def _posix(mapping: Mapping) -> str:
    lines = [f"unset {name}" for name in mapping.unset]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in mapping.set.items()]
    return "\n".join(lines) + "\n"


def _fish_quote(value: str) -> str:
    # Inside fish single quotes only \\ and \' are escapes.
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish(mapping: Mapping) -> str:
    lines = [f"set -e {name}" for name in mapping.unset]
    lines += [f"set -gx {name} {_fish_quote(value)}" for name, value in mapping.set.items()]
    return "\n".join(lines) + "\n"


def _powershell(mapping: Mapping) -> str:
    lines = [f"Remove-Item Env:{name} -ErrorAction SilentlyContinue" for name in mapping.unset]
    lines += [f"$env:{name} = '" + value.replace("'", "''") + "'" for name, value in mapping.set.items()]
    return "\n".join(lines) + "\n"


def _json(mapping: Mapping) -> str:
    return json.dumps({"set": mapping.set, "unset": list(mapping.unset)}, indent=2) + "\n"


def render(mapping: Mapping, shell: str) -> str:
    renderers = {"bash": _posix, "zsh": _posix, "fish": _fish, "powershell": _powershell, "json": _json}
    if shell not in renderers:
        raise ValueError(f"unknown shell {shell!r}; choose one of {', '.join(SHELLS)}")
    return renderers[shell](mapping)
