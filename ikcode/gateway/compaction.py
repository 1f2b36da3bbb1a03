"""Telling Claude Code's compaction (summary) requests apart from ordinary turns.

When its conversation nears the window, Claude Code forks the conversation with the same system
prompt and tools and appends one user message that asks for a summary. That message starts with
"Your task is to create a detailed summary of" in every client version checked (2.1.197 and
2.1.332: whole conversation, "this conversation", and "the RECENT portion" variants). The request
is otherwise an ordinary turn, so only the last user message tells it apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SUMMARY_MARKER = "Your task is to create a detailed summary of"


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    if isinstance(content, Sequence):
        for block in content:
            if (
                isinstance(block, Mapping)
                and block.get("type") == "text"
                and isinstance(block.get("text"), str)
            ):
                texts.append(block["text"])
            elif hasattr(block, "type") and getattr(block, "type", None) == "text":
                texts.append(str(getattr(block, "text", "")))
    return texts


def _role_and_content(message: Any) -> tuple[str | None, Any]:
    if isinstance(message, Mapping):
        return message.get("role"), message.get("content")
    return getattr(message, "role", None), getattr(message, "content", None)


def is_summary_request(body: Any) -> bool:
    """True for a compaction request: the last user message asks for the summary.

    Accepts the raw JSON body (a dict) or the parsed request (objects with .messages)."""
    messages = body.get("messages") if isinstance(body, Mapping) else getattr(body, "messages", None)
    if not messages:
        return False
    for message in reversed(messages):
        role, content = _role_and_content(message)
        if role == "user":
            return any(SUMMARY_MARKER in text for text in _texts(content))
    return False
