"""Options and helpers shared by several commands."""

from __future__ import annotations

import math
from typing import Any

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


class FiniteFloat(click.FloatRange):
    """A float in [min, max] that is a real number: click's FloatRange lets nan through (every
    comparison with nan is false), and `--timeout nan` once made `ikcode down` kill at once."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number
