"""Anthropic Messages request -> OpenAI chat completions request.

- `system` becomes the first system message; Claude Code's per-conversation attribution line
  (`x-anthropic-billing-header: ...`) is dropped so it never enters the upstream's shared prefix.
- Mid-conversation `role: "system"` messages stay where they are (hoisting them would break the
  append-only prefix the upstream caches).
- `tool_use` blocks become `tool_calls`; `tool_result` blocks become `role: "tool"` messages,
  placed right after the assistant turn that called them, before the user's other content.
- Thinking blocks are dropped (the upstream's reasoning is not signed; nothing to echo back).
- Unknown top-level fields are not forwarded: the upstream speaks another protocol.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from ikcode.gateway.content_text import document_text

ATTRIBUTION_PREFIX = "x-anthropic-billing-header:"


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text"]
    return "\n".join(parts)


def _image_part(block: dict[str, Any]) -> dict[str, Any] | None:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    elif source.get("type") == "url":
        url = source.get("url", "")
    else:
        return None
    return {"type": "image_url", "image_url": {"url": url}}


def _user_content(blocks: list[dict[str, Any]]) -> str | list[dict[str, Any]] | None:
    parts: list[dict[str, Any]] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image" and (image := _image_part(block)) is not None:
            parts.append(image)
        elif kind == "document":  # plain text, as the gateway reads it; a PDF's base64 is refused
            document = SimpleNamespace(source=block.get("source"), title=block.get("title"))
            parts.append({"type": "text", "text": document_text(document)})
    if not parts:
        return None
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)  # plain strings: every chat template takes them
    return parts


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    content = block.get("content")
    text = _text_of(content) if not isinstance(content, str) else content
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.get("tool_use_id", ""), "content": text}


def _assistant(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    texts, calls = [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind in ("tool_use", "server_tool_use"):
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        # thinking / redacted_thinking: dropped
    # A call-only turn says content "" rather than null: the spec allows null, but some servers
    # accept only a string (llama-cpp-python's schema) and their chat templates read it anyway.
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def convert_messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(system, str):
        system_text = system
    else:
        kept = [b for b in system or [] if not b.get("text", "").startswith(ATTRIBUTION_PREFIX)]
        system_text = "\n".join(b.get("text", "") for b in kept)
    if system_text:
        out.append({"role": "system", "content": system_text})
    for message in messages:
        role, content = message["role"], message["content"]
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif role == "assistant":
            out.append(_assistant(content))
        elif role == "system":
            out.append({"role": "system", "content": _text_of(content)})
        else:
            out.extend(_tool_result(b) for b in content if b.get("type") == "tool_result")
            rest = _user_content([b for b in content if b.get("type") != "tool_result"])
            if rest is not None or not any(b.get("type") == "tool_result" for b in content):
                out.append({"role": "user", "content": rest if rest is not None else ""})
    return out


def convert_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    converted = []
    for tool in tools or []:
        if tool.get("type") not in (None, "custom"):  # server tools (web search, ...) run at Anthropic
            continue
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
    return converted


def convert_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    if not choice:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name", "")}}, parallel
    return kind, parallel  # "auto" | "none"


def to_chat_request(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The chat completions body for an Anthropic Messages body (already validated)."""
    out: dict[str, Any] = {
        "model": model,
        "messages": convert_messages(body.get("system"), body["messages"]),
        "max_tokens": body["max_tokens"],
    }
    tools = convert_tools(body.get("tools"))
    if tools:
        out["tools"] = tools
        choice, parallel = convert_tool_choice(body.get("tool_choice"))
        if choice is not None:
            out["tool_choice"] = choice
        if parallel is not None:
            out["parallel_tool_calls"] = parallel
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if body.get(src) is not None:
            out[dst] = body[src]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    output_format = (body.get("output_config") or {}).get("format")
    if isinstance(output_format, dict) and output_format.get("type") == "json_schema":
        schema = {"name": "output", "schema": output_format.get("schema") or {}}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    if body.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out
