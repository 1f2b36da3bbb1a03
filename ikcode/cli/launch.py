"""Launcher commands: env, settings, claude, profiles, token."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from ikcode import auth
from ikcode.cli.common import profile_option, resolve_profile
from ikcode.cli.serve import running_endpoint
from ikcode.launcher import settings as claude_settings
from ikcode.launcher.claude import LauncherError, endpoint_problem, exec_claude, mapping_for, plan_launch
from ikcode.launcher.shells import SHELLS, render
from ikcode.profiles import ProfileError, list_profiles, load_profile

base_url_option = click.option(
    "--base-url", default=None, metavar="URL", help="Use this endpoint instead of the profile's."
)


def statusline_command() -> str:
    """How Claude Code runs `ikcode statusline`: this interpreter, so no PATH lookup is needed,
    and the request log of this IKCODE_HOME, so a claude started from a shell without it still
    reads the server it talks to."""
    from ikcode import daemon

    log = shlex.quote(str(daemon.request_log_file().resolve()))
    return f"{shlex.quote(sys.executable)} -m ikcode statusline --log {log}"


def _guess_shell() -> str:
    name = Path(os.environ.get("SHELL", "bash")).name
    return name if name in ("bash", "zsh", "fish") else "bash"


@click.command("env")
@profile_option
@base_url_option
@click.option("--shell", type=click.Choice(SHELLS), default=None, help="Output syntax (default: $SHELL).")
def env_command(profile_ref: str | None, base_url: str | None, shell: str | None) -> None:
    """Print the environment that maps every Claude Code role to the served model.

    Use it as: eval "$(ikcode env)"
    """
    profile = resolve_profile(profile_ref)
    url = base_url or running_endpoint(profile, named=profile_ref is not None)
    click.echo(render(_mapping(profile, url), shell or _guess_shell()), nl=False)


def _mapping(profile, url: str | None):
    """mapping_for, its refusals (a server elsewhere without IKCODE_TOKEN) as one line, not a traceback."""
    try:
        return mapping_for(profile, url)
    except LauncherError as err:
        raise click.ClickException(str(err)) from None


@click.command("settings")
@profile_option
@base_url_option
@click.option("--write", "action", flag_value="write", help="Merge the env block into a settings file.")
@click.option("--remove", "action", flag_value="remove", help="Take the env block out again.")
@click.option("--show", "action", flag_value="show", default=True, help="Show which source wins (default).")
@click.option("--scope", type=click.Choice(["project", "user"]), default="project", show_default=True)
@click.option("--statusline", is_flag=True, help="With --write: make `ikcode statusline` the status line.")
def settings_command(
    profile_ref: str | None, base_url: str | None, action: str, scope: str, statusline: bool
) -> None:
    """Write, remove or inspect the mapping in Claude Code's settings files."""
    profile = resolve_profile(profile_ref)
    mapping = _mapping(profile, base_url or running_endpoint(profile, named=profile_ref is not None))
    project = Path.cwd()
    try:
        if action == "write":
            path = claude_settings.scope_path(scope, project)
            command = statusline_command() if statusline else None
            backup, removed = claude_settings.write_env_block(path, mapping, command)
            click.echo(f"wrote {len(mapping.set)} variables to {path}")
            if command:
                click.echo(f"status line: {command}")
            if removed:
                click.echo(f"removed conflicting {', '.join(removed)}")
            if backup:
                click.echo(f"backup: {backup}")
            return
        if action == "remove":
            path = claude_settings.scope_path(scope, project)
            backup, removed = claude_settings.remove_env_block(path, mapping.names, mapping.model_overrides)
            click.echo(
                f"removed {len(removed)} variables from {path}" if removed else f"nothing to remove in {path}"
            )
            if backup:
                click.echo(f"backup: {backup}")
            return
    except claude_settings.SettingsError as err:
        raise click.ClickException(str(err)) from None
    reports = claude_settings.resolve(mapping, project, dict(os.environ))
    table = Table(title="What Claude Code will see (settings files beat the shell)")
    for column in ("variable", "wanted", "wins", "value there", "status"):
        table.add_column(column)
    for rep in reports:
        wanted = claude_settings.redact_value(rep.name, rep.expected) or "(unset)"
        value = claude_settings.redact_value(rep.name, rep.effective) or "-"
        style = {"ok": "green", "conflict": "red", "missing": "yellow"}[rep.status]
        table.add_row(rep.name, wanted, rep.winner or "-", value, f"[{style}]{rep.status}[/{style}]")
    Console().print(table)
    conflicts = [r for r in reports if r.status == "conflict"]
    if conflicts:
        for rep in conflicts:
            click.echo(
                f"conflict: {rep.name} comes from {rep.winner}; `ikcode claude` overrides it with "
                "--settings, a plain `claude` will not",
                err=True,
            )
        raise SystemExit(1)


@click.command(
    "claude",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@profile_option
@base_url_option
@click.option("--no-default-args", is_flag=True, help="Do not add the profile's default claude arguments.")
@click.argument("claude_args", nargs=-1, type=click.UNPROCESSED)
def claude_command(
    profile_ref: str | None, base_url: str | None, no_default_args: bool, claude_args: tuple[str, ...]
) -> None:
    """Run Claude Code against the served model: ikcode claude [OPTIONS] -- [CLAUDE ARGS]"""
    try:
        profile = load_profile(profile_ref)
    except ProfileError as err:
        # `ikcode claude -p "..."` meant claude's --print: ours is --profile.
        unknown = str(err).startswith("unknown profile")
        hint = ' (claude\'s own arguments go after --: ikcode claude -- -p "...")' if unknown else ""
        raise click.ClickException(f"{err}{hint}") from None
    if base_url is None and profile.engine != "upstream":
        from ikcode.cli.serve import ensure_stack
        from ikcode.daemon import DaemonError

        try:
            base_url = ensure_stack(profile, asked_for=profile_ref is not None)
        except DaemonError as err:
            raise click.ClickException(str(err)) from None
    else:  # an endpoint ikcode does not start: it must answer before claude is started on it
        url = base_url or profile.base_url
        if (problem := endpoint_problem(url)) is not None:
            raise click.ClickException(problem)
    try:
        plan = plan_launch(profile, list(claude_args), base_url, use_default_args=not no_default_args)
    except LauncherError as err:
        raise click.ClickException(str(err)) from None
    for notice in plan.notices:
        click.echo(f"ikcode: {notice}", err=True)
    exec_claude(plan)


@click.command("profiles")
def profiles_command() -> None:
    """List known profiles and the file each comes from."""
    table = Table()
    for column in ("name", "origin", "file"):
        table.add_column(column)
    for entry in list_profiles().values():
        table.add_row(entry.name, entry.origin, str(entry.path))
    Console().print(table)


@click.command("token")
@click.option("--show", is_flag=True, help="Print the token itself (careful: it is a secret).")
@click.option("--rotate", is_flag=True, help="Replace the launcher's token with a new one.")
@click.option("--add", "add_name", metavar="NAME", help="Add a named token for a team member (printed once).")
@click.option("--revoke", "revoke_name", metavar="NAME", help="Revoke a named token.")
@click.option("--list", "list_names", is_flag=True, help="List the named tokens.")
def token_command(
    show: bool, rotate: bool, add_name: str | None, revoke_name: str | None, list_names: bool
) -> None:
    """The bearer tokens the server accepts: the launcher's (mode 0600) and named team tokens.

    The server reads them at start: restart it (`ikcode down && ikcode up`) after a change.
    """
    restart = "the server reads tokens at start: restart it to apply (`ikcode down && ikcode up`)"
    actions = [rotate, add_name is not None, revoke_name is not None, list_names]
    if sum(actions) > 1:
        raise click.UsageError("give one of --rotate, --add, --revoke, --list at a time")
    if add_name is not None:  # "" too: refused with a reason, not taken for "no option"
        try:
            click.echo(auth.add_team_token(add_name))
        except ValueError as err:
            raise click.ClickException(str(err)) from None
        click.echo(restart, err=True)  # stdout holds the token alone, for scripts
        return
    if revoke_name is not None:
        try:
            revoked = auth.revoke_team_token(revoke_name)
        except ValueError as err:  # a damaged tokens.json: say which file
            raise click.ClickException(str(err)) from None
        if not revoked:
            raise click.ClickException(f"no token named {revoke_name!r}")
        click.echo(f"revoked {revoke_name}")
        click.echo(restart, err=True)
        return
    if list_names:
        try:
            named = auth.team_tokens()
        except ValueError as err:  # a damaged tokens.json: say which file
            raise click.ClickException(str(err)) from None
        for name, token in named.items():
            click.echo(f"{name}\t{auth.redact(token)}")
        return
    token = auth.rotate_token() if rotate else auth.load_or_create_token()
    click.echo(token if show else f"{auth.token_path()} ({auth.redact(token)})")
    if rotate:  # a running server still holds the old one: this machine's clients are refused
        click.echo(restart, err=True)
