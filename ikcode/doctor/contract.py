"""Contract: what Claude Code relies on. A streamed message with the usage fields it reads, a
tool-use round trip, count_tokens, and an error in Anthropic's shape."""

from __future__ import annotations

import uuid
from typing import Any

from ikcode.doctor.client import error_message
from ikcode.doctor.context import DoctorContext
from ikcode.doctor.result import CheckResult, failed, passed, warned

NAME = "contract"
START_USAGE = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
STREAM_ORDER = ("message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop")
TOOL = {
    "name": "Read",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
}


def _tool_round_trip(model: str) -> dict[str, Any]:
    call_id = "toolu_" + uuid.uuid4().hex[:20]
    return {
        "model": model,
        "max_tokens": 4,
        "temperature": 0,
        "tools": [TOOL],
        "messages": [
            {"role": "user", "content": "Read a.py"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": call_id, "name": "Read", "input": {"file_path": "a.py"}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call_id, "content": "x = 1"}],
            },
        ],
    }


def check_contract(ctx: DoctorContext) -> CheckResult:
    model = ctx.model_id or ctx.profile.served_model
    client = ctx.client
    problems: list[str] = []
    warnings: list[str] = []
    hello = {
        "model": model,
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    streamed = client.stream_message(hello)
    if streamed.status != 200 or streamed.error is not None:
        problems.append(f"streamed message failed ({streamed.status}: {error_message(streamed.error)})")
    else:
        kinds = streamed.kinds
        missing = [k for k in STREAM_ORDER if k not in kinds]
        if missing or kinds[0] != "message_start" or kinds[-1] != "message_stop":
            problems.append(f"stream events out of shape (missing {', '.join(missing) or 'none'})")
        start = next((e for e in streamed.events if e.get("type") == "message_start"), {})
        start_usage = (start.get("message") or {}).get("usage") or {}
        absent = [f for f in START_USAGE if f not in start_usage]
        if absent:
            problems.append(f"message_start usage lacks {', '.join(absent)}")
        if "output_tokens" not in streamed.usage:
            problems.append("message_delta usage lacks output_tokens")
    trip = client.post("/v1/messages", _tool_round_trip(model))
    if trip.status_code != 200 or (trip.json() if _is_json(trip) else {}).get("type") != "message":
        problems.append(f"tool_use/tool_result round trip answered {trip.status_code}: {_message(trip)}")
    counted = client.post("/v1/messages/count_tokens", {k: v for k, v in hello.items() if k != "max_tokens"})
    count = (counted.json() if _is_json(counted) else {}).get("input_tokens")
    if counted.status_code == 404:
        warnings.append("no count_tokens (the client falls back to max_tokens=1 calls for /context)")
    elif counted.status_code != 200 or not isinstance(count, int) or count <= 0:
        problems.append(f"count_tokens answered {counted.status_code} without input_tokens")
    bad = client.post("/v1/messages", {**hello, "max_tokens": 0})
    body = bad.json() if _is_json(bad) else {}
    error = body.get("error") if isinstance(body, dict) else None
    if not (400 <= bad.status_code < 500 and body.get("type") == "error" and isinstance(error, dict)
            and error.get("type") and error.get("message")):  # fmt: skip
        problems.append(f"an invalid request answered {bad.status_code} without Anthropic's error shape")
    data = {"stream_events": len(streamed.events), "count_tokens": count, "error_status": bad.status_code}
    if problems:
        return failed(
            NAME,
            "; ".join(problems),
            "the server must speak the Anthropic Messages API as "
            "Claude Code uses it (see docs of the engine or use the ikcode gateway in front)",
            **data,
        )
    if warnings:
        return warned(NAME, "; ".join(warnings), "add POST /v1/messages/count_tokens to the server", **data)
    return passed(
        NAME, "streaming with cache usage fields, tool round trip, count_tokens, error shape", **data
    )


def _is_json(response: Any) -> bool:
    try:
        response.json()
        return True
    except ValueError:
        return False


def _message(response: Any) -> str:
    return error_message(response.json()) if _is_json(response) else response.text[:120]
