"""OpenAI chat completion chunks -> Anthropic stream events, as they arrive.

Text deltas open a text block; each tool call index opens a tool_use block whose argument
fragments go out as `input_json_delta`. Reasoning deltas are dropped. The final usage chunk
(`stream_options.include_usage`) lands in `message_delta.usage`, which Claude Code reads as the
whole usage when it carries the full set. A server that ignores `include_usage`
(llama-cpp-python) sends none: output tokens are then the streamed delta chunks (one token each on
the servers that do this), marked "counted_by_ikcode"; prompt tokens stay 0 (unknown).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from ikcode.gateway.sse import sse_event

from .openai_response import UpstreamUsage, matched_stop, new_tool_id, stop_reason


class StreamTranslator:
    def __init__(self, message_id: str, model: str, stops: list[str]):
        self.message_id = message_id
        self.model = model
        self.stops = stops
        self.index = -1  # index of the open content block
        self.open_kind: str | None = None  # "text" | "tool_use"
        self.tool_blocks: dict[int, int] = {}  # OpenAI tool call index -> our block index
        self.lost_fragments = False  # a tool call's arguments came after its block was closed
        self.finish_reason: str | None = None
        self.matched_stop: Any = None
        self.usage = UpstreamUsage()
        self.saw_tools = False
        self.first_token = False  # a content or tool delta went out
        self.usage_reported = False
        self.delta_chunks = 0  # chunks that carried text or tool arguments

    def start(self) -> bytes:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": UpstreamUsage().anthropic(),  # the upstream tells usage only at the end
        }
        return sse_event({"type": "message_start", "message": message})

    def _open(self, kind: str, block: dict[str, Any]) -> Iterator[bytes]:
        yield from self._close()
        self.index += 1
        self.open_kind = kind
        yield sse_event({"type": "content_block_start", "index": self.index, "content_block": block})

    def _close(self) -> Iterator[bytes]:
        if self.open_kind is not None:
            yield sse_event({"type": "content_block_stop", "index": self.index})
            self.open_kind = None

    def feed(self, chunk: dict[str, Any]) -> Iterator[bytes]:
        if chunk.get("usage"):
            self.usage = UpstreamUsage.from_openai(chunk["usage"], chunk.get("timings"))
            self.usage_reported = True
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text or delta.get("tool_calls"):
                self.delta_chunks += 1
            if delta.get("reasoning_content") or delta.get("reasoning"):
                # A reasoning model's thinking (vLLM, SGLang, llama.cpp; not relayed): its prompt
                # is done, which is what admission waits for (a cold slot held through the
                # thinking kept every other new session queued).
                self.first_token = True
            if text:
                if self.open_kind != "text":
                    yield from self._open("text", {"type": "text", "text": ""})
                self.first_token = True
                yield sse_event(
                    {
                        "type": "content_block_delta",
                        "index": self.index,
                        "delta": {"type": "text_delta", "text": text},
                    }
                )
            for call in delta.get("tool_calls") or []:
                yield from self._tool_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.matched_stop = matched_stop(choice)

    def _tool_delta(self, call: dict[str, Any]) -> Iterator[bytes]:
        self.saw_tools = True
        index = call.get("index")
        if not isinstance(index, int):  # null or missing: a new call if it has an id, else the last's
            new = call.get("id") or not self.tool_blocks
            index = len(self.tool_blocks) if new else next(reversed(self.tool_blocks))
        position = index
        function = call.get("function") or {}
        if position not in self.tool_blocks:
            block = {
                "type": "tool_use",
                "id": call.get("id") or new_tool_id(),
                "name": function.get("name", ""),
                "input": {},
            }
            yield from self._open("tool_use", block)
            self.tool_blocks[position] = self.index
        elif self.tool_blocks[position] != self.index:
            # A late fragment for a block already closed (calls streamed interleaved): an
            # Anthropic stream cannot reopen it, and that call's input would be cut JSON.
            self.lost_fragments = True
            return
        arguments = function.get("arguments")
        if isinstance(arguments, dict):  # some servers send the arguments parsed
            arguments = json.dumps(arguments)
        elif arguments is not None and not isinstance(arguments, str):
            raise ValueError(f"tool call arguments of type {type(arguments).__name__}")
        if arguments:
            self.first_token = True
            delta = {"type": "input_json_delta", "partial_json": arguments}
            yield sse_event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def stop_reason_now(self) -> str:
        return stop_reason(self.finish_reason, self.matched_stop, self.stops, self.saw_tools)[0]

    @property
    def usage_source(self) -> str:
        return "reported_by_upstream" if self.usage_reported else "counted_by_ikcode"

    def finish(self) -> Iterator[bytes]:
        yield from self._close()
        if not self.usage_reported:
            self.usage.output_tokens = self.delta_chunks
        reason, sequence = stop_reason(self.finish_reason, self.matched_stop, self.stops, self.saw_tools)
        yield sse_event(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": self.usage.anthropic(),
            }
        )
        yield sse_event({"type": "message_stop"})
