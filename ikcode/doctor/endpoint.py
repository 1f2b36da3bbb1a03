"""Endpoint: reachable, healthy, how fast it answers, which model it serves and its window."""

from __future__ import annotations

import time

import httpx

from ikcode.doctor.client import error_message
from ikcode.doctor.context import DoctorContext
from ikcode.doctor.result import CheckResult, failed, passed, warned

NAME = "endpoint"


def check_endpoint(ctx: DoctorContext) -> CheckResult:
    url = ctx.base_url
    start_hint = "start it with `ikcode up`, or point at the right server with --base-url"
    started = time.monotonic()
    try:
        health = ctx.client.get("/health", timeout=httpx.Timeout(5.0, connect=3.0))
    except httpx.ConnectError as err:
        return failed(NAME, f"cannot connect to {url}: {_reason(err)}", start_hint, url=url)
    except httpx.TimeoutException:
        return failed(
            NAME, f"{url} did not answer within 5 s", f"check the server's logs (`ikcode logs`); {start_hint}"
        )
    except httpx.HTTPError as err:
        return failed(NAME, f"{url}: {err}", start_hint, url=url)
    latency_ms = (time.monotonic() - started) * 1000
    if health.status_code == 200:
        try:
            ctx.health = health.json()
        except ValueError:
            ctx.health = {}
    models = ctx.client.get("/v1/models", params={"limit": 1000}, timeout=10.0)
    if models.status_code in (401, 403):
        return failed(
            NAME,
            f"{url} refused the launcher's token ({models.status_code}: {error_message(_json(models))})",
            "the server was started with another token: restart it with `ikcode down && ikcode up`, "
            "or see `ikcode token`",
            url=url,
        )
    data = (_json(models) or {}).get("data") or []
    if models.status_code != 200 or not data or not isinstance(data[0], dict) or "id" not in data[0]:
        return failed(
            NAME,
            f"GET /v1/models answered {models.status_code} without a model list",
            "this is not an Anthropic-compatible endpoint, or its path prefix is wrong (--base-url)",
            url=url,
        )
    entry = data[0]
    ctx.reachable = True
    ctx.model_id = str(entry["id"])
    ctx.context_window = _int(entry.get("context_window") or entry.get("max_input_tokens"))
    ctx.max_output_tokens = _int(entry.get("max_output_tokens") or entry.get("max_tokens"))
    numbers = dict(
        url=url,
        latency_ms=round(latency_ms, 1),
        model=ctx.model_id,
        context_window=ctx.context_window,
        max_output_tokens=ctx.max_output_tokens,
        engine=ctx.health.get("engine"),
        device=ctx.health.get("device"),
    )
    window = f"{ctx.context_window:,}-token window" if ctx.context_window else "window not reported"
    detail = f"{url} serves {ctx.model_id} ({window}), /health in {latency_ms:.0f} ms"
    if health.status_code != 200:
        return warned(
            NAME, f"{detail}; /health answered {health.status_code}", "check `ikcode logs`", **numbers
        )
    if ctx.context_window is None:
        return warned(NAME, detail, "the server should report context_window in /v1/models", **numbers)
    return passed(NAME, detail, **numbers)


def _reason(err: Exception) -> str:
    text = str(err)
    if "refused" in text.lower() or "Errno 111" in text:
        return "connection refused (nothing listens there)"
    return text or type(err).__name__


def _json(response: httpx.Response) -> dict | None:
    try:
        data = response.json()
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
