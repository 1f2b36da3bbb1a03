"""`ikcode statusline`: the line Claude Code's `statusLine` command shows, from the server's side.

Claude Code runs the command after each turn and writes its session JSON to the command's stdin
(2.1.332: `session_id`, `model.id`, `context_window`, `prompt_cache`, ...). The client sees a
self-hosted server's cache only through the usage numbers; the server knows why a turn missed.
So the line is built from the request log (one JSON line per request, keyed by the
`X-Claude-Code-Session-Id` header, which is the same id as `session_id` here): the session's
last request, its hit rate and the tier it was served from, queue wait, TTFT, and the cause of
a miss. Pure functions apart from reading the log's tail; no prompt text is read or shown.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TAIL_BYTES = 1 << 20  # the log is append-only: a session's last request is near its end
MISS_BELOW_HIT_RATE = 0.5  # the gateway's own warm/cold line (WARM_HIT_RATE)


def parse_session(stdin_text: str) -> dict[str, Any]:
    """Claude Code's statusLine JSON; an empty or broken input gives {} (the line still prints)."""
    try:
        data = json.loads(stdin_text) if stdin_text.strip() else {}
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def last_request(log_path: Path, session_id: str | None) -> dict[str, Any] | None:
    """The newest request-log record of this session (None when there is none)."""
    if not session_id:
        return None
    try:
        with open(log_path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - TAIL_BYTES))
            tail = handle.read()
    except OSError:
        return None
    for raw in reversed(tail.split(b"\n")):
        if session_id.encode() not in raw:
            continue
        try:
            record = json.loads(raw)
        except ValueError:  # the first line of the tail may be cut
            continue
        if isinstance(record, dict) and record.get("session_id") == session_id:
            return record
    return None


def _cached(record: dict[str, Any]) -> tuple[int, str | None]:
    device = int(record.get("cached_tokens_device") or 0)
    host = int(record.get("cached_tokens_host") or 0)
    if device or host:
        return device + host, "device" if device >= host else "host"
    upstream = record.get("cached_tokens")  # an upstream server's own count (no tier known)
    return (int(upstream), "upstream") if isinstance(upstream, int) and upstream else (0, None)


def miss_cause(record: dict[str, Any]) -> str | None:
    """Why this request read little from the cache, as far as the server can tell."""
    if record.get("error"):
        return f"error: {str(record['error'])[:60]}"
    prompt = int(record.get("prompt_tokens") or 0)
    cached, _ = _cached(record)
    if not prompt or cached >= MISS_BELOW_HIT_RATE * prompt:
        return None
    previous = record.get("previous_prompt_tokens")
    if previous is None:
        return "first request"
    if record.get("prefix_break"):
        return f"prefix_break in {record['prefix_break']}"
    shared = int(record.get("prefix_shared_tokens") or 0)
    if shared > cached:
        return "evicted"
    return "cold"


def _ms(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value / 1000:.1f} s" if value >= 1000 else f"{value:.0f} ms"


def format_line(session: dict[str, Any], record: dict[str, Any] | None) -> str:
    model = (session.get("model") or {}).get("id") if isinstance(session.get("model"), dict) else None
    served = str((record or {}).get("model") or model or "?")[:100]  # a client's string, any type
    if record is None:
        return f"{served} · ikcode: no request of this session in the log yet"
    prompt = int(record.get("prompt_tokens") or 0)
    cached, tier = _cached(record)
    rate = f"{round(100 * cached / prompt)}%" if prompt else "-"
    parts = [
        served,
        f"cache {rate}" + (f" {tier}" if tier else ""),
        f"queue {_ms(record.get('queue_wait_ms'))}",
        f"TTFT {_ms(record.get('ttft_ms'))}",
    ]
    cause = miss_cause(record)
    if cause:
        parts.append(f"miss: {cause}")
    return " · ".join(parts)


def status_line(stdin_text: str, log_path: Path) -> str:
    session = parse_session(stdin_text)
    session_id = session.get("session_id") if isinstance(session.get("session_id"), str) else None
    return format_line(session, last_request(log_path, session_id))


def statusline_setting(command: str) -> dict[str, Any]:
    """The settings-file entry that makes Claude Code run `command` for its status line."""
    return {"type": "command", "command": command, "padding": 0}
