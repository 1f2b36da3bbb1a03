"""The `ikcode` command line: thin click commands over importable functions.

Commands are loaded lazily so that `ikcode env` does not pay for importing torch or FastAPI.
To add a command: write it in its own module under `ikcode.cli` and list it in COMMANDS.
"""

from __future__ import annotations

import importlib

import click

from ikcode import __version__

# command name -> "module:attribute"
COMMANDS: dict[str, str] = {
    "bench": "ikcode.cli.bench:bench_command",
    "doctor": "ikcode.cli.doctor:doctor_command",
    "plan": "ikcode.cli.plan:plan_command",
    "env": "ikcode.cli.launch:env_command",
    "settings": "ikcode.cli.launch:settings_command",
    "statusline": "ikcode.cli.statusline:statusline_command",
    "claude": "ikcode.cli.launch:claude_command",
    "profiles": "ikcode.cli.launch:profiles_command",
    "token": "ikcode.cli.launch:token_command",
    "up": "ikcode.cli.serve:up_command",
    "down": "ikcode.cli.serve:down_command",
    "status": "ikcode.cli.serve:status_command",
    "logs": "ikcode.cli.serve:logs_command",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except OSError as err:
            # An unusable IKCODE_HOME, state or log file: one line naming it, not a traceback.
            where = f" {err.filename}" if err.filename else ""
            raise click.ClickException(f"cannot use{where}: {err.strerror or err}") from None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ikcode")
def main() -> None:
    """Run Claude Code against a model served on your own hardware, fast."""
