"""OpenAI chat completion (and its errors) -> Anthropic Messages response.

Usage: `prompt_tokens_details.cached_tokens` is the upstream's own cache report; when it is
missing the upstream did not say, and `cache_read_input_tokens` is 0 with `cache_reported` False
(the request log says "not reported by upstream" rather than inventing a number).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from ikcode.gateway.errors import ERROR_TYPES, error_body

FINISH_TO_STOP = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
_CONTEXT = re.compile(r"maximum context length is (\d+) tokens.*?(?:requested|has) (\d+)", re.S | re.I)
# The prompt fits, the prompt and max_tokens together do not. vLLM's two wordings (old:
# serving_engine.py `_validate_prompt_and_tokenize`; new: "'max_tokens' or 'max_completion_tokens'
# is too large: M. This model's maximum context length is N tokens and your request has P input
# tokens (M > N - P)."), as (limit, prompt, max_tokens).
_OVER_NEW = re.compile(
    r"too large: (\d+)\. This model's maximum context length is (\d+) tokens and your request has (\d+)"
)
_OVER_OLD = re.compile(
    r"maximum context length is (\d+) tokens\. However, you requested \d+ tokens "
    r"\((\d+) in the messages, (\d+) in the completion\)"
)


@dataclass
class UpstreamUsage:
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # None: the upstream did not report its cache

    @classmethod
    def from_openai(cls, usage: dict[str, Any] | None, timings: Any = None) -> UpstreamUsage:
        """`timings.cache_n` is llama.cpp's llama-server report of prompt tokens reused from
        its slot's cache, used when `prompt_tokens_details` says nothing."""
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached is None and isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
            cached = timings["cache_n"]
        return cls(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0), cached)

    def anthropic(self) -> dict[str, int]:
        cached = self.cached_tokens or 0
        return {
            "input_tokens": max(0, self.prompt_tokens - cached),
            "output_tokens": self.output_tokens,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        }


def new_tool_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def parse_arguments(arguments: str | None) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def matched_stop(choice: dict[str, Any]) -> Any:
    """The stop string (or token id) that ended a choice: vLLM names it `stop_reason`, SGLang
    `matched_stop` (python/sglang/srt/entrypoints/openai/protocol.py, the choice models)."""
    named = choice.get("stop_reason")
    return named if named is not None else choice.get("matched_stop")


def stop_reason(
    finish_reason: str | None, matched: Any, stops: list[str], has_tools: bool
) -> tuple[str, str | None]:
    if finish_reason == "length":
        return "max_tokens", None  # a tool call cut by the limit has unfinished arguments
    if has_tools:
        return "tool_use", None
    if finish_reason == "stop" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return FINISH_TO_STOP.get(finish_reason or "stop", "end_turn"), None


def to_message(
    completion: dict[str, Any], message_id: str, model: str, stops: list[str]
) -> tuple[dict, UpstreamUsage]:
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or new_tool_id(),
                "name": function.get("name", ""),
                "input": parse_arguments(function.get("arguments")),
            }
        )
    reason, sequence = stop_reason(choice.get("finish_reason"), matched_stop(choice), stops, bool(calls))
    usage = UpstreamUsage.from_openai(completion.get("usage"), completion.get("timings"))
    body = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage.anthropic(),
    }
    return body, usage


def error_message(raw: bytes) -> str:
    """The upstream's own error text (OpenAI, FastAPI or plain shapes)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw.decode("utf-8", "replace")[:2000] or "upstream error"
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data.get("message")))
        if isinstance(error, dict):
            return str(error.get("message") or error)
        if error is not None:
            return str(error)
    return json.dumps(data)[:2000]


def to_anthropic_error(status: int, raw: bytes) -> tuple[int, dict[str, Any]]:
    """An OpenAI-style error as Anthropic's; a context overflow says "prompt is too long" (the
    wording that starts Claude Code's own compaction)."""
    message = error_message(raw)
    if status in (400, 413, 422) and (over := _context_overflow(message)) is not None:
        limit, prompt, max_tokens = over
        if prompt < limit:  # Anthropic's words for it: Claude Code retries with a max_tokens that fits
            return 400, error_body(
                "invalid_request_error",
                f"input length and `max_tokens` exceed context limit: {prompt} + {max_tokens} > {limit}, "
                "decrease input length or `max_tokens` and try again",
            )
        return 400, error_body(
            "invalid_request_error", f"prompt is too long: {prompt} tokens > {limit} maximum"
        )
    found = _CONTEXT.search(message)
    if found and status in (400, 413, 422):
        limit, requested = found.groups()
        return 400, error_body(
            "invalid_request_error", f"prompt is too long: {requested} tokens > {limit} maximum"
        )
    if status == 422:
        status = 400
    if status in (401, 403):
        # The replica refused the front's own credentials ([upstream] token), not the client's:
        # passed on as they are, Claude Code would tell its user that their key is wrong.
        return 500, error_body(
            "api_error", f"upstream refused this server's credentials ({status}): {message}"
        )
    return status, error_body(ERROR_TYPES.get(status, "api_error"), f"upstream: {message}")


def _context_overflow(message: str) -> tuple[int, int, int] | None:
    """(context limit, prompt tokens, max_tokens) of an error about prompt + max_tokens."""
    if found := _OVER_NEW.search(message):
        max_tokens, limit, prompt = (int(g) for g in found.groups())
        return limit, prompt, max_tokens
    if found := _OVER_OLD.search(message):
        limit, prompt, max_tokens = (int(g) for g in found.groups())
        return limit, prompt, max_tokens
    return None
