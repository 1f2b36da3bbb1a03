"""Silent-miss detector: sessions whose consecutive requests share a long prefix but got little of
it from the cache. A miss looks like a slow GPU; the request log tells them apart.

Per pair of consecutive requests of one session (X-Claude-Code-Session-Id):
- shared = tokens at the start of this prompt equal to the previous prompt (`prefix_shared_tokens`,
  logged by the gateway; without it, the previous prompt's length when this one is longer);
- a silent miss: shared >= MIN_SHARED and the cache served less than half of it;
- a prefix break: the previous prompt was long but this one repeats less than half of it (the
  rendered prompt changed: a per-request system line, a re-rendered turn, an edited history).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ikcode.doctor.context import DoctorContext
from ikcode.doctor.request_log import cached_tokens, no_log_result, read_records, record_time, this_run
from ikcode.doctor.result import CheckResult, failed, passed, warned

NAME = "silent_miss"
MIN_SHARED = 256  # tokens: below this a miss costs little and block rounding dominates
MISS_FRACTION = 0.5


def _overlaps(previous: dict[str, Any], current: dict[str, Any]) -> bool:
    """The previous request was still running when this one arrived (its blocks not committed yet)."""
    start, now = record_time(previous), record_time(current)
    if start is None or now is None:
        return False
    return start + float(previous.get("duration_ms") or 0) / 1000 > now


def analyse(records: list[dict[str, Any]]) -> dict[str, Any]:
    # A session is its user's own (the gateway compares a prompt only with the same user's
    # previous one): another token sending the same id is another session.
    sessions: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record.get("session_id") and not record.get("error"):
            user = record.get("user")
            name = record["session_id"] if not user else f"{record['session_id']} ({user})"
            sessions[name].append(record)
    any_hit = any(cached_tokens(r) > 0 for r in records)
    per_session: dict[str, dict[str, Any]] = {}
    misses: list[dict[str, Any]] = []
    breaks: list[dict[str, Any]] = []
    expected_total = cached_total = 0
    for session, items in sessions.items():
        prompt = sum(r["prompt_tokens"] for r in items)
        cached = sum(cached_tokens(r) for r in items)
        stats = {
            "requests": len(items),
            "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "misses": 0,
        }
        for previous, current in zip(items, items[1:], strict=False):
            shared = current.get("prefix_shared_tokens")
            if shared is None:
                longer = current["prompt_tokens"] >= previous["prompt_tokens"]
                shared = previous["prompt_tokens"] if longer else 0
            got = cached_tokens(current)
            if previous["prompt_tokens"] >= MIN_SHARED and shared < MISS_FRACTION * previous["prompt_tokens"]:
                breaks.append(
                    {
                        "session_id": session,
                        "request_id": current.get("request_id"),
                        "shared": shared,
                        "previous": previous["prompt_tokens"],
                        "where": current.get("prefix_break"),
                    }
                )
                continue
            if shared < MIN_SHARED or _overlaps(previous, current):
                continue
            expected_total += shared
            cached_total += min(got, shared)
            if got < MISS_FRACTION * shared:
                stats["misses"] += 1
                misses.append(
                    {
                        "session_id": session,
                        "request_id": current.get("request_id"),
                        "shared": shared,
                        "cached": got,
                    }
                )
        per_session[session] = stats
    return {
        "sessions": len(sessions),
        "pairs_checked": sum(max(0, len(v) - 1) for v in sessions.values()),
        "repeat_hit_rate": round(cached_total / expected_total, 4) if expected_total else None,
        "misses": misses[-20:],
        "miss_count": len(misses),
        "breaks": breaks[-20:],
        "break_count": len(breaks),
        "any_hit": any_hit,
        "per_session": dict(list(per_session.items())[-20:]),
    }


def _break_cause(breaks: list[dict[str, Any]]) -> str:
    wheres = {b.get("where") for b in breaks}
    if wheres == {"system"}:
        return "the system prompt or tools changed between turns (e.g. a per-request attribution line)"
    if "system" not in wheres and None not in wheres:
        return (
            "an earlier turn was rendered differently (e.g. a re-rendered assistant turn or edited history)"
        )
    return (
        "the rendered prompt changed between turns (a changing system line, a re-rendered turn, compaction)"
    )


def engine_commit_failures(ctx: DoctorContext) -> int:
    """Cache commits the engine reported as failed (`ikcode_cache_commit_failures` on /metrics,
    exposed by engines whose commit runs inside the engine's own release path, e.g. DeepInfer's
    finalize_seq). 0 when the endpoint does not report it or cannot be read."""
    from ikcode.doctor.client import EndpointClient

    client = EndpointClient(ctx.base_url, ctx.token, read_timeout_s=30.0)
    try:
        response = client.get("/metrics")
        if response.status_code != 200:
            return 0
        for line in response.text.splitlines():
            if line.startswith("ikcode_cache_commit_failures "):
                return int(float(line.split()[1]))
    except Exception:
        return 0
    finally:
        client.close()
    return 0


def check_silent_miss(ctx: DoctorContext) -> CheckResult:
    failures = engine_commit_failures(ctx)
    if failures:
        return failed(
            NAME,
            f"the engine failed to commit {failures} finished request(s) to the prefix cache: "
            "those prefixes will never be served from cache (the server log says why)",
            "read the gateway log for 'cache commit failed'; fix the cause and restart",
            commit_failures=failures,
        )
    records = read_records(ctx.request_log)
    if records is None:
        return no_log_result(ctx, NAME, "look for silent misses")
    records = this_run(records, (ctx.health or {}).get("started_at"))
    result = analyse(records)
    if result["pairs_checked"] == 0:
        return warned(
            NAME,
            f"{len(records)} requests in the log, none a repeat within a session yet",
            "run doctor again after some Claude Code turns (or without --skip of the quality gate)",
            **result,
        )
    misses, breaks = result["miss_count"], result["break_count"]
    rate = result["repeat_hit_rate"]
    rate_text = "n/a" if rate is None else f"{rate:.1%}"
    if misses:
        worst = result["misses"][-1]
        cause = (
            (
                "the cache never hit: entries are not committed (e.g. committed at the final token "
                "instead of when the engine releases the sequence) or prefix caching is off"
            )
            if not result["any_hit"]
            else (
                "eviction: the cache dropped these sessions' blocks "
                "(too small for the sessions active at once)"
            )
        )
        detail = (
            f"{misses} of {result['pairs_checked']} repeated turns missed the cache although they repeated "
            f"the previous prompt (e.g. {worst['shared']:,} tokens shared, {worst['cached']:,} cached); "
            f"likely cause: {cause}"
        )
        fix = (
            "commit prefix-cache entries when the engine releases a sequence; then run `ikcode doctor` again"
            if not result["any_hit"]
            else "give the cache tier more memory or run fewer sessions at once (`ikcode plan`)"
        )
        if rate is not None and rate >= 0.9 and result["any_hit"]:
            return warned(NAME, detail, fix, **result)
        return failed(NAME, detail, fix, **result)
    if breaks:
        return warned(
            NAME,
            f"{breaks} turn(s) did not repeat the previous prompt: {_break_cause(result['breaks'])}; "
            f"repeats served {rate_text} from cache",
            "set CLAUDE_CODE_ATTRIBUTION_HEADER=0 (`ikcode claude` does) and keep history append-only",
            **result,
        )
    return passed(
        NAME,
        f"{result['pairs_checked']} repeated turns in {result['sessions']} sessions: "
        f"{rate_text} of the repeated prefix served from cache",
        **result,
    )
