"""`ikcode doctor`: checks of the endpoint, the API contract, the role mapping, the cache."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from ikcode.cli.common import profile_option, resolve_profile


@click.command("doctor")
@profile_option
@click.option(
    "--base-url", default=None, help="Endpoint to check (default: the running server, else the profile's)."
)
@click.option("--json", "as_json", is_flag=True, help='Print {"ok", "checks": [...]} as JSON.')
@click.option("--quick", "mode", flag_value="quick", default=True, help="One needle document (default).")
@click.option("--full", "mode", flag_value="full", help="Several needle documents, up to 200K tokens.")
@click.option(
    "--request-log",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The server's requests.jsonl (default: the local server's).",
)
@click.option("--only", multiple=True, metavar="CHECK", help="Run only these checks (repeatable).")
def doctor_command(
    profile_ref: str | None,
    base_url: str | None,
    as_json: bool,
    mode: str,
    request_log: Path | None,
    only: tuple[str, ...],
) -> None:
    """Check the stack: exit 0 only when no check failed."""
    from ikcode import auth, daemon
    from ikcode.doctor import NAMES, DoctorContext, report, run_checks
    from ikcode.doctor.request_log import local_request_log

    unknown = [name for name in only if name not in NAMES]
    if unknown:
        raise click.BadParameter(
            f"unknown check(s) {', '.join(unknown)}; known: {', '.join(NAMES)}", param_hint="--only"
        )
    profile = resolve_profile(profile_ref)
    if base_url is None:
        running = daemon.read_state()
        base_url = running.url if running is not None else profile.base_url
    ctx = DoctorContext(
        profile=profile,
        base_url=base_url,
        token=auth.client_token(base_url),
        mode=mode,
        request_log=request_log or local_request_log(base_url),
    )
    started = time.monotonic()
    results = run_checks(ctx, list(only) or None)
    document = report(
        results,
        base_url=base_url,
        profile=profile.name,
        mode=mode,
        seconds=round(time.monotonic() - started, 2),
    )
    if as_json:
        click.echo(json.dumps(document, indent=2, default=str))
    else:
        from rich.console import Console

        from ikcode.doctor.render import render_table

        render_table(results, Console(), f"ikcode doctor ({mode}) {base_url}")
    sys.exit(0 if document["ok"] else 1)
