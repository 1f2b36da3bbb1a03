"""What a request may cost before the server pays for it: bytes, then characters, then tokens.

Each check is cheaper than the next and runs first, so an oversized request leaves early:
  bytes       the body, against a limit derived from the context window (Content-Length before
              a byte is read, else counted while the body streams in);
  characters  the prompt text, after parsing and before tokenizing: a token covers at most
              `max_token_chars` characters, so more characters than window * that many cannot
              fit, whatever the tokenizer makes of them;
  tokens      the rendered prompt, against the context window (messages.create_message).
Without the first two, a 30 MB prompt was tokenized whole before the length check: half a
minute with the server frozen and gigabytes of memory.
"""

from __future__ import annotations

import math
from typing import Any

from ikcode.engines.base import PromptTooLong
from ikcode.gateway.errors import invalid_request
from ikcode.gateway.schemas import CountTokensRequest, MessagesRequest

# Bytes of JSON one prompt token can take in a legitimate request: a token is a few characters,
# a character at most 6 bytes escaped (\uXXXX), with block and tool-schema overhead around it.
MAX_BODY_BYTES_PER_TOKEN = 64
# Room for what is not prompt text (headers of blocks, metadata) in a small window.
MIN_BODY_BYTES = 1024 * 1024


def body_limit_bytes(context_window: int, max_body_bytes: int) -> int:
    """The largest body worth reading for a model with this context window."""
    return min(max_body_bytes, max(MIN_BODY_BYTES, context_window * MAX_BODY_BYTES_PER_TOKEN))


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters any one token of the vocabulary decodes to (None: unknown).

    Byte-level vocabularies spell each byte as one character, so a token's spelling is at least
    as long as the text it decodes to: an upper bound, which is all the character check needs.
    """
    id_to_token = getattr(tokenizer, "id_to_token", None)
    size = getattr(tokenizer, "vocab_size", None)
    if id_to_token is None or not isinstance(size, int) or size <= 0:
        return None
    longest = max(len(id_to_token(i) or "") for i in range(size))
    return longest or None


def _string_chars(value: Any) -> int:
    """Characters of the strings in a JSON value (keys included): a tool call's arguments are
    rendered as JSON, so each of these strings stands in the prompt, escaped or as is."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(k)) + _string_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_string_chars(v) for v in value)
    return 0


def _text_chars(content: Any, loaded: dict[str, int]) -> int:
    """Characters of prompt text in a message's content: text, documents, tool results, tool
    calls' arguments, and each deferred tool a tool_reference loads (its definition is written
    where the reference stands, once per reference: `loaded` maps a deferred tool's name to its
    characters). The rest (thinking, which some formats drop) is left out, which only makes the
    bound lower: the token check still sees everything."""
    if isinstance(content, str):
        return len(content.strip())
    total = 0
    for block in content or ():
        kind = getattr(block, "type", None)
        if kind == "text":
            total += len(block.text.strip())
        elif kind == "tool_result":
            total += _text_chars(block.content, loaded)
        elif kind in ("tool_use", "server_tool_use"):
            total += _string_chars(block.input)
        elif kind == "tool_reference":
            total += loaded.get(block.tool_name, 0)
        elif kind == "document":
            total += _document_chars(block.source)
    return total


def _document_chars(source: Any) -> int:
    """The text a document renders as (content_text.document_text): its data, or its blocks' texts."""
    if not isinstance(source, dict):
        return 0
    if isinstance(source.get("data"), str):
        return len(source["data"])
    blocks = source.get("content") if isinstance(source.get("content"), list) else []
    return sum(len(b["text"]) for b in blocks if isinstance(b, dict) and isinstance(b.get("text"), str))


def _loaded_chars(tools: list[Any] | None) -> dict[str, int]:
    """A deferred tool's characters as a tool_reference loads it: name, description and every
    string of its schema (content_text.loaded_tools_text writes the schema whole)."""
    return {
        tool.name: len(tool.name) + len(tool.description or "") + _string_chars(tool.input_schema)
        for tool in tools or ()
        if tool.defer_loading
    }


def _tool_chars(tools: list[Any] | None) -> int:
    """Characters every tool format writes for the tools the prompt lists (deferred ones stay out
    until loaded): a callable tool's name and description, and each parameter's name and
    description. The JSON formats write the whole schema; harmony and qwen3_coder only these of
    it, so counting more could refuse a prompt that fits."""
    return sum(
        len(tool.name) + len((tool.description or "").strip()) + _parameter_chars(tool.input_schema)
        for tool in tools or ()
        if tool.input_schema is not None and not tool.defer_loading
    )


def _parameter_chars(schema: dict[str, Any]) -> int:
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return 0
    total = 0
    for name, spec in properties.items():
        description = spec.get("description") if isinstance(spec, dict) else None
        total += len(str(name)) + (len(description.strip()) if isinstance(description, str) else 0)
    return total


def prompt_chars(body: MessagesRequest | CountTokensRequest) -> int:
    system = body.system
    chars = len(system.strip()) if isinstance(system, str) else sum(len(s.text.strip()) for s in system or ())
    chars += _tool_chars(body.tools)
    loaded = _loaded_chars(body.tools)
    return chars + sum(_text_chars(message.content, loaded) for message in body.messages)


def check_prompt_chars(
    body: MessagesRequest | CountTokensRequest, context_window: int, token_chars: int | None
) -> None:
    """400 "prompt is too long" (Claude Code's wording, so it compacts) when the prompt text holds
    more characters than the window's tokens could spell; the count given is a lower bound."""
    if token_chars is None:
        return
    chars = prompt_chars(body)
    if chars <= (context_window - 1) * token_chars:
        return
    at_least = math.ceil(chars / token_chars)
    raise invalid_request(str(PromptTooLong(at_least, context_window - 1)))
