"""Launch the real `claude` with every role mapped to the served model.

The mapping goes both into the child's environment and into a `--settings` file, because a
settings file's env block beats the shell: a stale ANTHROPIC_MODEL in the user's settings would
otherwise win over what we export.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ikcode import auth, paths
from ikcode.launcher.rolemap import Mapping, claude_env
from ikcode.profiles import Profile

NPM_HINT = "npm install -g @anthropic-ai/claude-code"
# The release the tests run (scripts/test.sh pins it); `ikcode doctor` flags an older one.
TESTED_CLAUDE_VERSION = (2, 1, 332)


class LauncherError(Exception):
    pass


@dataclass(frozen=True)
class ServedModel:
    name: str
    context_window: int
    max_output_tokens: int
    source: str  # "profile" or "server"


@dataclass
class LaunchPlan:
    mapping: Mapping
    settings_path: Path
    argv: list[str]
    notices: list[str] = field(default_factory=list)


def discover_served_model(base_url: str, token: str | None, timeout_s: float = 2.0) -> ServedModel | None:
    """Ask a running server which model it serves (GET /v1/models). None when it cannot tell."""
    headers = {"anthropic-version": "2023-06-01"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        response = httpx.get(
            f"{base_url.rstrip('/')}/v1/models",
            headers=headers,
            timeout=timeout_s,
            trust_env=auth.proxied(base_url),
        )
        data = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if response.status_code != 200 or not data or not isinstance(data[0], dict) or "id" not in data[0]:
        return None
    entry = data[0]
    window = entry.get("context_window") or entry.get("max_input_tokens")
    output = entry.get("max_output_tokens") or entry.get("max_tokens")
    if not isinstance(window, int) or not isinstance(output, int):
        return None
    return ServedModel(str(entry["id"]), window, output, "server")


def endpoint_problem(base_url: str, timeout_s: float = 5.0) -> str | None:
    """Why claude could not reach base_url, or None when something answers there (any status:
    a 401 or 404 is still a server; Claude Code's own error would come after minutes of retries)."""
    try:
        # trust_env=False: as for the daemon's health check, a proxy must not route this away.
        httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=timeout_s, trust_env=False)
    except httpx.TransportError as err:
        return (
            f"nothing answers at {base_url} ({type(err).__name__}): start the server there "
            "(`ikcode up`), or give the right --base-url"
        )
    return None


def served_model_for(profile: Profile, base_url: str, token: str | None, discover: bool) -> ServedModel:
    if discover:
        found = discover_served_model(base_url, token)
        if found is not None:
            return found
    return ServedModel(profile.served_model, profile.context_window, profile.max_output_tokens, "profile")


def mapping_for(profile: Profile, base_url: str | None = None, discover: bool = True) -> Mapping:
    url = base_url or profile.base_url
    token = auth.client_token(url)
    if token is None:
        raise LauncherError(
            f"{url} is not on this machine: set IKCODE_TOKEN to your token for that server "
            "(its owner makes one with `ikcode token --add NAME`); this machine's own token stays here"
        )
    served = served_model_for(profile, url, token, discover)
    return claude_env(
        served_model=served.name,
        base_url=url,
        token=token,
        context_window=served.context_window,
        max_output_tokens=served.max_output_tokens,
        api_timeout_ms=profile.claude.api_timeout_ms,
        compact_at_fraction=profile.compaction.compact_at_fraction,
        no_proxy=os.environ.get("NO_PROXY") or os.environ.get("no_proxy") or "",
    )


def find_claude() -> str:
    explicit = os.environ.get("IKCODE_CLAUDE_BIN")
    if explicit:
        if not os.path.isfile(explicit) or not os.access(explicit, os.X_OK):
            raise LauncherError(f"IKCODE_CLAUDE_BIN={explicit} is not an executable file")
        return explicit
    found = shutil.which("claude")
    if found is None:
        raise LauncherError(f"`claude` (Claude Code) is not on PATH. Install it with: {NPM_HINT}")
    return found


def _flags(args: list[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in args if arg.startswith("-")}


def default_args_for(profile: Profile, user_args: list[str]) -> list[str]:
    """The profile's default claude arguments whose flags the user did not give themselves, each
    flag with its value as one `--flag=value` argument: Claude Code's `--tools` takes any number
    of values, so `--tools Bash,Read` right before the user's prompt took the prompt for a tool
    (when the user's own `--system-prompt` had dropped the default that followed it)."""
    defaults = profile.claude.default_args
    given = _flags(user_args)
    kept: list[str] = []
    i = 0
    while i < len(defaults):
        flag = defaults[i]
        takes_value = i + 1 < len(defaults) and not defaults[i + 1].startswith("-")
        group = defaults[i : i + 2] if takes_value else defaults[i : i + 1]
        if flag.split("=", 1)[0] not in given:
            kept.append("=".join(group))
        i += len(group)
    return kept


def write_settings_file(mapping: Mapping) -> Path:
    """The `--settings` file of this launch: one per launch (this process becomes claude, so its
    pid names it; two launches at once no longer write one file), files of launches that ended
    removed. Its env block also blanks what the mapping removes from the shell: a settings file
    beats the shell, and a user's settings.json holding ANTHROPIC_API_KEY or
    CLAUDE_CODE_USE_BEDROCK would otherwise still win (the key then went to this server, or the
    session to another provider); Claude Code takes an empty value as unset."""
    folder = paths.ensure(paths.state_dir() / "claude-settings")
    _remove_ended_launches(folder)
    env = {name: "" for name in mapping.unset} | mapping.set
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")  # mode 0600, a fresh name
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump({"env": env, "modelOverrides": mapping.model_overrides}, handle, indent=2)
    path = folder / f"{os.getpid()}.json"
    os.replace(tmp, path)
    return path


def _remove_ended_launches(folder: Path) -> None:
    for old in folder.glob("*.json"):
        if old.stem.isdigit() and not _alive(int(old.stem)):
            old.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def plan_launch(
    profile: Profile,
    user_args: list[str],
    base_url: str | None = None,
    use_default_args: bool = True,
    discover: bool = True,
) -> LaunchPlan:
    mapping = mapping_for(profile, base_url, discover)
    settings_path = write_settings_file(mapping)
    notices = []
    extra = default_args_for(profile, user_args) if use_default_args else []
    if extra:
        notices.append(
            f"profile {profile.name!r} adds claude arguments {' '.join(extra)!s} "
            f"(its model's {profile.context_window}-token window is small); "
            "pass your own flags after -- or use --no-default-args to override"
        )
    argv = [find_claude(), "--settings", str(settings_path), *extra, *user_args]
    return LaunchPlan(mapping, settings_path, argv, notices)


def exec_claude(plan: LaunchPlan) -> None:
    """Replace this process with claude (its exit code becomes ours)."""
    env = plan.mapping.apply(dict(os.environ))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(plan.argv[0], plan.argv, env)
