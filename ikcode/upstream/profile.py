"""The upstream front from a profile (what `ikcode up --profile vllm` serves)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from ikcode.admission import AdmissionConfig
from ikcode.gateway.settings import GatewaySettings

from .app import create_upstream_app
from .config import UpstreamConfig
from .router import shown_url


def upstream_config(table: dict[str, Any], source: str = "profile") -> UpstreamConfig:
    try:
        return UpstreamConfig.from_dict(table)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: [upstream] {err}") from None


def upstream_app(profile: Any, settings: GatewaySettings) -> tuple[FastAPI, str]:
    """The app for an `engine = "upstream"` profile, and a line describing it for the log."""
    config = upstream_config(profile.upstream, profile.source or profile.name)
    # Shown without the user, password or query a replica URL may carry: this line goes to
    # server.log and to `ikcode up`'s progress line.
    shown = ", ".join(shown_url(url) for url in config.urls)
    what = f"upstream {config.kind} front over {len(config.urls)} replica(s): {shown}"
    if config.token_env and not config.token:
        what += f" (warning: ${config.token_env} is not set; no upstream token sent)"
    admission = AdmissionConfig.from_dict(getattr(profile, "admission", None))
    what += f"; admission {admission.policy}"
    return create_upstream_app(config, settings, admission), what
