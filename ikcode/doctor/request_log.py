"""The server's request log (JSON lines), read from its tail; where it lives for a local server."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ikcode import daemon
from ikcode.auth import is_loopback
from ikcode.doctor.result import SKIP, CheckResult, warned

TAIL_BYTES = 16 * 1024 * 1024
NO_LOG_FIX = "run doctor on the server's machine, or pass --request-log PATH (the server's requests.jsonl)"


def no_log_result(ctx: Any, name: str, what: str) -> CheckResult:
    """Without a request log: a skip when the server is down (the log is found through the
    running server), else a warning that says where to run doctor."""
    if not ctx.reachable:
        return CheckResult(name, SKIP, "not run: the endpoint does not answer", "")
    return warned(name, f"no request log here: cannot {what}", NO_LOG_FIX)


def local_request_log(base_url: str) -> Path | None:
    """The running local server's request log, when base_url points at it."""
    state = daemon.read_state()
    parsed = urlparse(base_url)
    if state is None or not is_loopback(parsed.hostname or "") or parsed.port != state.port:
        return None
    path = daemon.request_log_file()
    return path if path.is_file() else None


def read_records(path: Path | None, max_records: int = 5000) -> list[dict[str, Any]] | None:
    """The last max_records requests that reached the engine; None when the log is not readable."""
    if path is None:
        return None
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - TAIL_BYTES))
            raw = handle.read()
    except OSError:
        return None
    # Split on newlines only: str.splitlines also breaks on U+0085 / U+2028, which the log
    # writes unescaped inside a string (a session header holding one would split its record).
    lines = [line.decode("utf-8", errors="replace") for line in raw.split(b"\n")]
    if size > TAIL_BYTES and lines:
        lines = lines[1:]  # the first line may be cut
    records = []
    for line in lines[-max_records:]:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("prompt_tokens"), int):
            records.append(record)
    return records


def cached_tokens(record: dict[str, Any]) -> int:
    """Prompt tokens the request read from cache: the gateway's count by tier, or an upstream
    front's `cached_tokens` (the upstream server's own report, no tier known)."""
    tiers = int(record.get("cached_tokens_device") or 0) + int(record.get("cached_tokens_host") or 0)
    upstream = record.get("cached_tokens")
    return tiers or (upstream if isinstance(upstream, int) and not isinstance(upstream, bool) else 0)


def record_time(record: dict[str, Any]) -> float | None:
    """A record's `ts` as a Unix time (None when it has none)."""
    try:
        return datetime.fromisoformat(record["ts"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return None


def this_run(records: list[dict[str, Any]], started_at: Any) -> list[dict[str, Any]]:
    """The records the running server wrote: the log is appended to across restarts, and what a
    run before a fix did must not fail the fixed server (/health's started_at; all without it)."""
    try:
        start = datetime.fromisoformat(started_at).timestamp()
    except (TypeError, ValueError):
        return records
    return [r for r in records if (record_time(r) or 0.0) >= start]
