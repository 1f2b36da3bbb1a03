"""Message content -> the text a tool format renders, one function per kind of turn.

User turns become ("text" | "result", value) items that the tool format joins; assistant turns
become ("text" | "call" | "thinking", value) items. Blocks the served model cannot read are
refused with an Anthropic invalid_request error, except an image inside a tool result, which
becomes a placeholder line (refusing it would wedge the client's session). A tool result holding
`tool_reference` blocks shows the referenced deferred tools' definitions (see `loaded_tools_text`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ikcode.gateway.errors import invalid_request
from ikcode.gateway.tool_formats import CallItem, ResultItem, ToolFormat

IMAGE_PLACEHOLDER = "[image omitted: the served model reads text only]"
BILLING_HEADER = "x-anthropic-billing-header"


def unguarded(text: str) -> str:
    """The guard of a vocabulary without marker tokens: nothing to guard."""
    return text


@dataclass(frozen=True)
class Guards:
    """How client strings are guarded (Renderer): text, and a tool's name (which lands inside
    role markers, so every special token string in it is guarded)."""

    text: Callable[[str], str] = unguarded
    name: Callable[[str], str] = unguarded


def user_items(
    content: list[Any],
    names: dict[str, str],
    deferred: dict[str, Any],
    guards: Guards = Guards(),
    joiner: str = "\n",
) -> list[tuple[str, Any]]:
    """A user turn's items. Adjacent texts are joined with the format's joiner before they are
    guarded: joined with "" after, "x <tool_" and "call>" made a marker no guard had seen."""
    items: list[tuple[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            items.append(("text", guards.text(joiner.join(texts))))
            texts.clear()

    for block in content:
        kind = block.type
        if kind == "text":
            texts.append(block.text)
        elif kind == "document":
            texts.append(document_text(block))
        elif kind == "tool_result":
            flush()
            name = guards.name(names.get(block.tool_use_id, ""))
            text = guards.text(result_text(block.content, deferred))
            items.append(("result", ResultItem(block.tool_use_id, name, text, bool(block.is_error))))
        elif kind == "image":
            raise invalid_request("image content is not supported: the served model reads text only")
        elif kind in ("tool_use", "server_tool_use"):
            raise invalid_request("messages: tool_use blocks may only appear in assistant messages")
        # thinking blocks in a user turn carry nothing for the model
    flush()
    return items


def user_text(
    content: str | list[Any],
    names: dict[str, str],
    deferred: dict[str, Any],
    tool_format: ToolFormat,
    guards: Guards = Guards(),
) -> str:
    if isinstance(content, str):
        return guards.text(content)
    return tool_format.user_text(user_items(content, names, deferred, guards, tool_format.text_joiner))


def result_text(content: str | list[Any] | None, deferred: dict[str, Any]) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    references = [block.tool_name for block in content if block.type == "tool_reference"]
    if references:
        parts.append(loaded_tools_text(references, deferred))
    for block in content:
        if block.type == "tool_reference":
            continue
        if block.type == "text":
            parts.append(block.text)
        elif block.type == "image":  # e.g. Read on a picture: refusing would wedge the session
            parts.append(IMAGE_PLACEHOLDER)
        else:
            parts.append(document_text(block))
    return "\n".join(parts)


def system_text(system: str | list[Any] | None) -> str:
    if system is None:
        return ""
    texts = (
        [system]
        if isinstance(system, str)
        else [block["text"] if isinstance(block, dict) else block.text for block in system]
    )
    kept = []
    for text in texts:
        if BILLING_HEADER in text:
            text = "\n".join(line for line in text.split("\n") if not line.startswith(BILLING_HEADER))
        if text.strip():
            kept.append(text)
    return "\n\n".join(kept)


def system_message_text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(block.text for block in content if block.type == "text")


def assistant_text(content: str | list[Any], tool_format: ToolFormat) -> str:
    if isinstance(content, str):  # the same turn as one text block (harmony frames it)
        return tool_format.assistant_text([("text", content)])
    items: list[tuple[str, Any]] = []
    for block in content:
        kind = block.type
        if kind == "text":
            items.append(("text", block.text))
        elif kind in ("tool_use", "server_tool_use"):
            items.append(("call", CallItem(block.id, block.name, block.input)))
        elif kind == "thinking":
            items.append(("thinking", block.thinking))
        elif kind in ("tool_result", "image", "document"):
            raise invalid_request(f"messages: {kind} blocks may not appear in assistant messages")
    return tool_format.assistant_text(items)


def guard_strings(value: Any, guard: Callable[[str], str]) -> Any:
    """value with guard applied to every string in it, keys included (a JSON value)."""
    if guard is unguarded:
        return value
    if isinstance(value, str):
        return guard(value)
    if isinstance(value, dict):
        return {guard(str(k)): guard_strings(v, guard) for k, v in value.items()}
    if isinstance(value, list):
        return [guard_strings(v, guard) for v in value]
    return value


def loaded_tools_text(names: list[str], deferred: dict[str, Any]) -> str:
    """Deferred tools loaded by a tool search, as its description promises the model: one
    <function>{"description", "name", "parameters"}</function> line each inside <functions>."""
    lines = []
    for name in names:
        tool = deferred.get(name)
        if tool is None:  # not among this request's tools: the name is all there is to show
            definition: dict[str, Any] = {"name": name}
        else:
            definition = {
                "description": tool.description or "",
                "name": name,
                "parameters": tool.input_schema,
            }
        lines.append(f"<function>{json.dumps(definition, ensure_ascii=False)}</function>")
    return "<functions>\n" + "\n".join(lines) + "\n</functions>"


def document_text(block: Any) -> str:
    source = block.source if isinstance(block.source, dict) else {}
    title = getattr(block, "title", None)
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif source.get("type") == "content" and isinstance(source.get("content"), list):
        text = "\n".join(
            b["text"] for b in source["content"] if isinstance(b, dict) and isinstance(b.get("text"), str)
        )
    else:
        raise invalid_request("document content is supported only as plain text (source type 'text')")
    return f"{title}\n{text}" if title else text


def call_names(turns: list[tuple[str, Any]]) -> dict[str, str]:
    """tool_use id -> tool name: some formats name the tool beside its result (gpt-oss)."""
    return {
        block.id: block.name
        for role, content in turns
        if role == "assistant" and not isinstance(content, str)
        for block in content
        if getattr(block, "type", None) in ("tool_use", "server_tool_use")
    }


def merge_assistant_turns(messages: list[Any]) -> list[tuple[str, Any]]:
    """Consecutive assistant messages are one turn (clients split a reply's blocks)."""
    turns: list[tuple[str, Any]] = []
    for message in messages:
        role, content = message.role, message.content
        if role == "assistant" and turns and turns[-1][0] == "assistant":
            previous = turns[-1][1]
            as_list = lambda c: [_TextLike(c)] if isinstance(c, str) else list(c)  # noqa: E731
            turns[-1] = ("assistant", as_list(previous) + as_list(content))
        else:
            turns.append((role, content))
    return turns


@dataclass
class _TextLike:
    text: str
    type: str = "text"
