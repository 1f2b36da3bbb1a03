"""Serving commands: up, down, status, logs."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import BinaryIO

import click
import httpx
from rich.console import Console

from ikcode import auth, daemon
from ikcode.cli.common import FiniteFloat, profile_option, resolve_profile
from ikcode.profiles import Profile


def _port_for(profile: Profile, port: int | None) -> int:
    return port if port is not None else profile.endpoint.port


DEFAULT_START_TIMEOUT_S = 600.0


def start_stack(profile: Profile, port: int | None = None, model: str | None = None) -> daemon.ServerState:
    """Start the stack in the background and wait until it is healthy, showing progress."""
    port = _port_for(profile, port)
    # The host too: the child reads the profile file, which does not hold a --host override.
    args = ["up", "--foreground", "--profile", profile.source, "--port", str(port)]
    args += ["--host", profile.endpoint.host]
    if model:
        args += ["--model", model]
    url = profile.model_copy(update={"endpoint": profile.endpoint.model_copy(update={"port": port})}).base_url
    console = Console(stderr=True)
    with console.status(f"starting ikcode ({profile.name}) on {url}") as status:

        def progress(line: str) -> None:
            if line:
                status.update(f"starting ikcode ({profile.name}): {line[-100:]}")

        return daemon.start_background(
            args,
            profile.endpoint.host,
            port,
            url,
            profile.name,
            timeout_s=start_timeout_s(profile),
            on_progress=progress,
        )


def start_timeout_s(profile: Profile) -> float:
    """How long `ikcode up` waits for the server to answer: 10 minutes, or a DeepInfer profile's
    own rank start timeout and two minutes more (its ranks may load for longer, and the server
    was stopped at 10 minutes while they were still within theirs)."""
    if profile.engine != "deepinfer":
        return DEFAULT_START_TIMEOUT_S
    from ikcode.engines.deepinfer.config import DeepInferConfig

    ranks_s = float(profile.deepinfer.get("rank_start_timeout_s") or DeepInferConfig.rank_start_timeout_s)
    return max(DEFAULT_START_TIMEOUT_S, ranks_s + 120.0)


def ensure_stack(profile: Profile, asked_for: bool = False) -> str:
    """The profile's endpoint, started first when nothing answers there (used by `ikcode claude`).
    `asked_for`: the user named this profile; a server of another profile on its port is then
    an error (its model and the profile's claude arguments would not match). Under the start
    lock: a launcher started at the same time waits, then finds the server this one started."""
    with daemon.start_lock():
        return _ensure_stack(profile, asked_for)


def running_endpoint(profile: Profile, named: bool) -> str:
    """Where the profile is served now: the running server's URL when it answers and serves this
    profile (`ikcode up --port N` moved it), else the profile's own. `named`: the user named the
    profile; an unnamed one takes whatever server runs."""
    running = daemon.read_state()
    if running is not None and (not named or running.profile == profile.name):
        if daemon.health(running.url) is not None:
            return running.url
    return profile.base_url


def _ensure_stack(profile: Profile, asked_for: bool) -> str:
    running = daemon.read_state()
    other = running is not None and running.profile != profile.name

    def serving_another() -> daemon.DaemonError:
        assert running is not None
        return daemon.DaemonError(
            f"ikcode is serving profile {running.profile!r} at {running.url}, not {profile.name!r}: "
            f"stop it first (`ikcode down`), or run `ikcode claude --profile {running.profile}`"
        )

    if daemon.health(profile.base_url) is not None:
        # Only a server this user started (its state file, its process) gets the launcher's
        # token and the session's prompts: on a shared machine the port may be another user's
        # ikcode, or any program.
        if running is None or running.port != profile.endpoint.port:
            raise daemon.DaemonError(
                f"something other than this user's ikcode answers at {profile.base_url}: stop it, or "
                f"serve on another port (`ikcode up --port N`, then `ikcode claude`)"
            )
        if asked_for and other and running.url == profile.base_url:
            raise serving_another()
        return profile.base_url
    if running is not None and daemon.health(running.url) is not None:
        if asked_for and other:  # a profile asked for by name is served by itself, or not at all
            raise serving_another()
        return running.url
    state = start_stack(profile)
    click.echo(f"ikcode: serving {profile.served_model} at {state.url} (stop with `ikcode down`)", err=True)
    return state.url


@click.command("up")
@profile_option
@click.option("--model", default=None, metavar="PATH", help="A GGUF file or Hugging Face checkpoint dir.")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Port (default: the profile's).")
@click.option("--host", default=None, help="Bind address (default: the profile's, 127.0.0.1).")
@click.option("--foreground", is_flag=True, help="Run in this terminal instead of in the background.")
def up_command(
    profile_ref: str | None, model: str | None, port: int | None, host: str | None, foreground: bool
) -> None:
    """Start the serving stack and print its endpoint."""
    profile = resolve_profile(profile_ref)
    if host:
        profile = profile.model_copy(update={"endpoint": profile.endpoint.model_copy(update={"host": host})})
    if foreground:
        from ikcode.stack import serve_foreground

        try:
            serve_foreground(profile, port=_port_for(profile, port), model_path=model)
        except daemon.DaemonError as err:
            raise click.ClickException(str(err)) from None
        return
    try:
        with daemon.start_lock():
            state = start_stack(profile, port, model)
    except daemon.DaemonError as err:
        raise click.ClickException(str(err)) from None
    click.echo(f"ikcode is serving {profile.served_model} at {state.url} (pid {state.pid})")
    click.echo("logs: ikcode logs -f    stop: ikcode down    use it: ikcode claude")


@click.command("down")
@click.option(
    "--timeout", type=FiniteFloat(0, 86400), default=60.0, show_default=True, help="Seconds to drain requests"
)
def down_command(timeout: float) -> None:
    """Stop the serving stack (in-flight requests finish first)."""
    state = daemon.stop(timeout_s=timeout)
    if state is None:
        click.echo("ikcode is not running")
        return
    click.echo(f"stopped ikcode (pid {state.pid}) at {state.url}")


def _summary(url: str, token: str) -> dict:
    headers = {"Authorization": f"Bearer {token}", "anthropic-version": "2023-06-01"}
    out: dict = {}
    try:
        # The local server, never through an HTTP_PROXY from the environment (it would get the token).
        out["health"] = httpx.get(f"{url}/health", headers=headers, timeout=3, trust_env=False).json()
        answer = httpx.get(f"{url}/v1/models", headers=headers, timeout=3, trust_env=False)
        if answer.status_code != 200:  # a token the server does not know (rotated since its start)
            out["error"] = f"/v1/models answered {answer.status_code}: {answer.text[:200]}"
            return out
        models = answer.json().get("data") or []
        out["model"] = models[0] if models else None
    except (httpx.HTTPError, ValueError) as err:
        out["error"] = str(err) or type(err).__name__
    return out


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status_command(as_json: bool) -> None:
    """Endpoint, model, uptime, requests and cache hit rate of the running stack."""
    state = daemon.read_state()
    if state is None:
        if as_json:
            click.echo(json.dumps({"running": False}))
        else:
            click.echo("ikcode is not running (start it with `ikcode up`)")
        raise SystemExit(3)
    info = _summary(state.url, auth.load_or_create_token())
    health = info.get("health") or {}
    report = {
        "running": True,
        "pid": state.pid,
        "url": state.url,
        "profile": state.profile,
        "uptime_s": round(time.time() - state.started_at, 1),
        "model": (info.get("model") or {}).get("id"),
        **{k: v for k, v in health.items() if k not in ("status",)},
    }
    if "error" in info:
        report["error"] = info["error"]
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            click.echo(f"{key:>22}: {value}")
    if "error" in report:  # running, but not answering as it should
        raise SystemExit(1)


@click.command("logs")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
@click.option("-n", "--lines", type=click.IntRange(min=0), default=50, show_default=True)
@click.option("--requests", is_flag=True, help="Show the per-request log (JSON lines) instead.")
def logs_command(follow: bool, lines: int, requests: bool) -> None:
    """Show the server log (or the per-request log)."""
    path: Path = daemon.request_log_file() if requests else daemon.log_file()
    if not path.exists():
        raise click.ClickException(f"no log yet at {path}")
    handle = path.open("rb")
    try:
        click.echo(last_lines(handle, lines).decode(errors="replace"), nl=False)
        handle.seek(0, os.SEEK_END)
        while follow:
            line = handle.readline()
            if line:
                click.echo(line.decode(errors="replace"), nl=False)
                continue
            if _replaced(path, handle):  # rotated (server.log.1, requests.jsonl.1): the new file
                handle.close()
                handle = path.open("rb")
                continue
            time.sleep(0.25)
    finally:
        handle.close()


def last_lines(handle: BinaryIO, count: int, chunk: int = 65536) -> bytes:
    """The last `count` lines of a file, read backwards from its end (a log can be 64 MB)."""
    if count <= 0:
        return b""
    end = handle.seek(0, os.SEEK_END)
    data, position = b"", end
    while position > 0 and data.count(b"\n") <= count:
        step = min(chunk, position)
        position -= step
        handle.seek(position)
        data = handle.read(step) + data
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-count:])


def _replaced(path: Path, handle: BinaryIO) -> bool:
    """Whether the file at path is no longer the one open (moved aside, or truncated)."""
    try:
        now = path.stat()
    except FileNotFoundError:
        return False  # between the move and the new file: look again
    opened = os.fstat(handle.fileno())
    return (now.st_ino, now.st_dev) != (opened.st_ino, opened.st_dev) or now.st_size < handle.tell()
