"""Options and helpers shared by several commands."""

from __future__ import annotations

import click

from ikcode.profiles import Profile, ProfileError, load_profile

profile_option = click.option(
    "--profile",
    "-p",
    "profile_ref",
    default=None,
    metavar="NAME|PATH",
    help="Profile name (see `ikcode profiles`) or path to a TOML file. Default: local.",
)


def resolve_profile(profile_ref: str | None) -> Profile:
    try:
        return load_profile(profile_ref)
    except ProfileError as err:
        raise click.ClickException(str(err)) from None
