"""Generated token ids -> Anthropic content blocks and stream events.

One pipeline for streaming and non-streaming answers: ids -> incremental detokenizer -> the
tool format's parser -> stop sequence matcher (over the reply's text, not a call's arguments: a
stop sequence inside them cut the call short) -> blocks. A tool call's block opens as soon as the
parser knows the call, and its arguments stream as input_json_delta pieces while it is generated.
Each `push` returns the stream events it produced (content_block_start / content_block_delta /
content_block_stop as dicts); `content` holds the finished blocks for a non-streaming answer and
for the reply store.
"""

from __future__ import annotations

from typing import Any

from ikcode.gateway.chat_format import TokenizerLike
from ikcode.gateway.detokenize import IncrementalDetokenizer
from ikcode.gateway.tool_formats import (
    HermesFormat,
    ParseEvent,
    StreamParser,
    ToolArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)

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
    def __init__(
        self,
        tokenizer: TokenizerLike,
        hidden_ids: tuple[int, ...],  # left out of the text (Renderer.hidden_token_ids)
        stop_sequences: list[str],
        parser: StreamParser | None = None,
        one_call: bool = False,
    ):
        self._detok = IncrementalDetokenizer(tokenizer, skip_ids=hidden_ids)
        self._stops = StopSequenceMatcher(stop_sequences)
        self._parser = parser or HermesFormat().new_parser([])
        self._open_tool: int | None = None  # index of the tool_use block being written
        self.generated_ids: list[int] = []
        self.content: list[dict[str, Any]] = []
        self._open_text: int | None = None  # index of the text block being written
        self._pending_space = ""  # whitespace not yet worth opening a block for
        self.done = False  # a stop sequence matched, or the one call allowed ended: generate no more
        self.one_call = one_call  # disable_parallel_tool_use: the reply ends with its first call
        self.one_call_done = False

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
        text = self._detok.push(token_ids)
        return self._emit(self._parser.feed(text)) if text else []

    def finish(self) -> list[dict[str, Any]]:
        """The end of the reply: flush held text, parse an unclosed call, close the last block.
        A stop sequence found only now (in text held back for a broken character at the end)
        cuts the reply there too: done, and its ids hold text the client never got."""
        events: list[dict[str, Any]] = []
        if not self.done:
            tail = self._detok.flush()
            events += self._emit(self._parser.feed(tail)) if tail else []
        if not self.done:  # after a stop or the one call asked for, what the parser holds is not sent
            events += self._emit(self._parser.finish())
        if not self.done:
            events += self._text_events(self._stops.flush())
        events += self._close_text()
        return events

    # -- blocks -------------------------------------------------------------------------------
    def _emit(self, items: list[ParseEvent]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, ToolCallStart):
                # text held for a stop sequence spanning deltas: none can span a call
                events += self._text_events(self._stops.flush())
                events += self._close_text() + self._tool_start(item)
            elif isinstance(item, ToolArgsDelta):
                events += self._tool_delta(item.partial_json)
            elif isinstance(item, ToolCallEnd):
                events += self._tool_end(item.input)
                if self.one_call:
                    self.done = self.one_call_done = True
                    break  # what follows the call would be more calls: not asked for
            else:
                events += self._text_events(self._stops.feed(item.text))
                if self._stops.matched is not None:
                    self.done = True
                    break  # what follows the stop sequence is not sent
        return events

    def _text_events(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
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

    def _tool_start(self, call: ToolCallStart) -> list[dict[str, Any]]:
        self._open_tool = len(self.content)
        self.content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        return [{"type": "content_block_start", "index": self._open_tool, "content_block": block}]

    def _tool_delta(self, partial_json: str) -> list[dict[str, Any]]:
        assert self._open_tool is not None, "arguments before their call"
        step = JSON_CHUNK_CHARS
        pieces = [partial_json[at : at + step] for at in range(0, len(partial_json), step)]
        return [
            {
                "type": "content_block_delta",
                "index": self._open_tool,
                "delta": {"type": "input_json_delta", "partial_json": piece},
            }
            for piece in pieces
        ]

    def _tool_end(self, tool_input: dict[str, Any]) -> list[dict[str, Any]]:
        assert self._open_tool is not None, "the end of a call that never started"
        index, self._open_tool = self._open_tool, None
        self.content[index]["input"] = tool_input
        return [{"type": "content_block_stop", "index": index}]
