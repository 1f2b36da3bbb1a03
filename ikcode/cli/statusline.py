"""`ikcode statusline`: the command for Claude Code's `statusLine` setting."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command("statusline")
@click.option(
    "--log",
    "log_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Request log to read (default: the one `ikcode up` writes).",
)
def statusline_command(log_path: Path | None) -> None:
    """Print one status line for Claude Code from the session JSON on stdin.

    Served model, this session's last cache hit rate and tier, queue wait, TTFT, and the
    cause of a miss. Install it with: ikcode settings --write --statusline
    """
    from ikcode import daemon
    from ikcode.launcher.statusline import status_line

    click.echo(status_line(sys.stdin.read(), log_path or daemon.request_log_file()))
