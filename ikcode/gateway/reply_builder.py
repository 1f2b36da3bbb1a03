"""Generated token ids -> Anthropic content blocks and stream events.

One pipeline for streaming and non-streaming answers: ids -> incremental detokenizer -> stop
sequence matcher -> tool-call parser -> blocks. Each `push` returns the stream events it produced
(content_block_start / content_block_delta / content_block_stop as dicts); `content` holds the
finished blocks for a non-streaming answer and for the reply store.
"""

from __future__ import annotations

import json
from typing import Any

from ikcode.gateway.chat_format import TokenizerLike
from ikcode.gateway.detokenize import IncrementalDetokenizer
from ikcode.gateway.tool_parse import TextPiece, ToolCall, ToolCallParser

JSON_CHUNK_CHARS = 256  # input_json_delta pieces, so large tool inputs still stream in steps


class StopSequenceMatcher:
    """Holds back just enough text to see a stop sequence that spans deltas."""

    def __init__(self, stop_sequences: list[str]):
        self.stops = [s for s in stop_sequences if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self._buf += text
        found = [(self._buf.find(s), s) for s in self.stops]
        found = [(at, s) for at, s in found if at >= 0]
        if found:
            at, stop = min(found)
            self.matched = stop
            out, self._buf = self._buf[:at], ""
            return out
        cut = max(0, len(self._buf) - self._hold)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return out


class ReplyBuilder:
    def __init__(self, tokenizer: TokenizerLike, stop_token_ids: tuple[int, ...], stop_sequences: list[str]):
        self._detok = IncrementalDetokenizer(tokenizer, skip_ids=stop_token_ids)
        self._stops = StopSequenceMatcher(stop_sequences)
        self._parser = ToolCallParser()
        self.generated_ids: list[int] = []
        self.content: list[dict[str, Any]] = []
        self._open_text: int | None = None  # index of the text block being written
        self._pending_space = ""  # whitespace not yet worth opening a block for
        self.done = False  # a stop sequence matched: generate no more

    @property
    def stop_sequence(self) -> str | None:
        return self._stops.matched

    @property
    def called_tool(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.content)

    def push(self, token_ids: list[int]) -> list[dict[str, Any]]:
        if self.done:
            return []
        self.generated_ids.extend(token_ids)
        text = self._stops.feed(self._detok.push(token_ids))
        if self._stops.matched is not None:
            self.done = True
        return self._emit(self._parser.feed(text)) if text else []

    def finish(self) -> list[dict[str, Any]]:
        """The end of the reply: flush held text, parse an unclosed call, close the last block."""
        events: list[dict[str, Any]] = []
        if not self.done:
            tail = self._stops.feed(self._detok.flush()) + (
                "" if self._stops.matched else self._stops.flush()
            )
            events += self._emit(self._parser.feed(tail)) if tail else []
        events += self._emit(self._parser.finish())
        events += self._close_text()
        return events

    # -- blocks -------------------------------------------------------------------------------
    def _emit(self, items: list[TextPiece | ToolCall]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, ToolCall):
                events += self._close_text()
                events += self._tool_events(item)
            else:
                events += self._text_events(item.text)
        return events

    def _text_events(self, text: str) -> list[dict[str, Any]]:
        if self._open_text is None:
            if not text.strip():
                self._pending_space += text
                return []
            text, self._pending_space = self._pending_space + text, ""
            self._open_text = len(self.content)
            self.content.append({"type": "text", "text": ""})
            start = {
                "type": "content_block_start",
                "index": self._open_text,
                "content_block": {"type": "text", "text": ""},
            }
            events = [start]
        else:
            events = []
        self.content[self._open_text]["text"] += text
        delta = {"type": "text_delta", "text": text}
        return events + [{"type": "content_block_delta", "index": self._open_text, "delta": delta}]

    def _close_text(self) -> list[dict[str, Any]]:
        self._pending_space = ""
        if self._open_text is None:
            return []
        index, self._open_text = self._open_text, None
        return [{"type": "content_block_stop", "index": index}]

    def _tool_events(self, call: ToolCall) -> list[dict[str, Any]]:
        index = len(self.content)
        self.content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.input})
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        events: list[dict[str, Any]] = [
            {"type": "content_block_start", "index": index, "content_block": block}
        ]
        raw = json.dumps(call.input, ensure_ascii=False)
        for at in range(0, len(raw), JSON_CHUNK_CHARS):
            delta = {"type": "input_json_delta", "partial_json": raw[at : at + JSON_CHUNK_CHARS]}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})
        return events
