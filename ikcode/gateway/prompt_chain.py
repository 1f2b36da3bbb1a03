"""The chain a prompt is built as: one digest per segment, chained, so that equal chain digests
mean equal token prefixes (block hashing resumes there, a remembered reply is found there), and
the rendered prompt that carries it to the cache and the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any

from ikcode.gateway.previous_render import PreviousRender

ROOT = b"\x00" * 16


def digest(data: bytes) -> bytes:
    return blake2b(data, digest_size=16).digest()


def chain_digest(parent: bytes, key: bytes) -> bytes:
    return blake2b(parent + key, digest_size=16).digest()


def reply_key(salt: str, chain: bytes) -> bytes:
    """Where the reply to a prompt ending at `chain` is remembered: per user when salted."""
    return chain_digest(salt.encode(), chain) if salt else chain


def get_field(block: Any, name: str) -> Any:
    return block.get(name) if isinstance(block, dict) else getattr(block, name, None)


@dataclass
class RenderedPrompt:
    token_ids: list[int]
    reply_prefix_key: bytes | None  # chain digest before the reply; None for a prefill
    fresh_tokens: int  # tokens tokenized by this render (the rest came from the store)
    segments: int
    # (chain digest, token count) after each segment: equal digests mean equal token prefixes,
    # which lets block hashing resume where an earlier prompt of the conversation ended.
    boundaries: list[tuple[bytes, int]] = field(default_factory=list)
    # The tools the reply may call, for its parser: none under tool_choice "none".
    tools: list[dict[str, Any]] = field(default_factory=list)
    # Tokens copied from a previous render of the conversation (see previous_render), and that
    # render's token list: both prompts hold the same first reused_tokens tokens.
    reused_tokens: int = 0
    reused_from: list[int] | None = None
    one_call: bool = False  # tool_choice's disable_parallel_tool_use: at most one call in the reply


def assistant_content_key(content: str | list[Any]) -> bytes:
    """Digest of an assistant turn as the client echoes a reply back (ids, names, inputs, text
    blocks without their surrounding whitespace): the key of a remembered reply, whose tokens are
    the ones generated, under its own user's salt. Not a key of a rendering: two turns with one
    such key may render differently (key order of an input, empty text blocks)."""
    h = blake2b(digest_size=16)
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    for block in blocks:
        kind = get_field(block, "type")
        if kind == "text":
            text = get_field(block, "text").strip()
            if text:
                h.update(b"\x00t%d\x00" % len(text) + text.encode())
        elif kind in ("tool_use", "server_tool_use"):
            tool_input = json.dumps(get_field(block, "input"), sort_keys=True, ensure_ascii=False)
            h.update(
                b"\x00u" + json.dumps([get_field(block, "id"), get_field(block, "name"), tool_input]).encode()
            )
        elif kind == "thinking":
            thinking = get_field(block, "thinking")
            h.update(b"\x00k%d\x00" % len(thinking) + thinking.encode())
        elif kind == "redacted_thinking":
            data = get_field(block, "data")
            h.update(b"\x00r%d\x00" % len(data) + data.encode())
    return h.digest()


@dataclass
class PromptBuild:
    """A prompt being built: its ids, the chain digest so far and a boundary after each segment."""

    ids: list[int]
    chain: bytes = ROOT
    fresh: int = 0
    boundaries: list[tuple[bytes, int]] = field(default_factory=list)

    @classmethod
    def copied(cls, previous: PreviousRender, num_turns: int, fresh: int) -> PromptBuild:
        """The previous render's prompt up to the end of its first num_turns turns (a copy)."""
        chain, end = previous.end_of_turns(num_turns)
        boundaries = previous.boundaries[: previous.num_head_boundaries + num_turns]
        return cls(previous.token_ids[:end], chain, fresh, boundaries)

    def add(self, key: bytes, segment: list[int], fresh: int, boundary: bool = True) -> None:
        self.ids.extend(segment)
        self.chain = chain_digest(self.chain, key)
        self.fresh += fresh
        if boundary:
            self.boundaries.append((self.chain, len(self.ids)))
