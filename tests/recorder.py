"""A loopback HTTP recorder that answers the Messages API with a canned streamed reply."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def canned_stream(model: str, text: str = "hi there", input_tokens: int = 10) -> bytes:
    block, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": text}
    return _stream(model, block, delta, "end_turn", input_tokens)


def tool_use_stream(model: str, name: str, tool_input: dict, tool_id: str = "toolu_rec01") -> bytes:
    """A streamed reply that calls one tool (the client then runs it and sends the result back)."""
    block = {"type": "tool_use", "id": tool_id, "name": name, "input": {}}
    delta = {"type": "input_json_delta", "partial_json": json.dumps(tool_input)}
    return _stream(model, block, delta, "tool_use")


_message_ids = itertools.count(1)


def _stream(model: str, block: dict, delta: dict, stop_reason: str, input_tokens: int = 10) -> bytes:
    usage = {
        "input_tokens": input_tokens,
        "output_tokens": 0,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    message = {
        # One id per reply: the client merges consecutive assistant messages that share an id.
        "id": f"msg_rec{next(_message_ids):04d}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    return b"".join(
        [
            _sse("message_start", {"type": "message_start", "message": message}),
            _sse(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": block},
            ),
            _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
            _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                    "usage": {"output_tokens": 3},
                },
            ),
            _sse("message_stop", {"type": "message_stop"}),
        ]
    )


class Recorder:
    """Records every request (method, path, headers, JSON body) and answers with canned data.

    `replies` scripts the streamed answers in order (each a function of the requested model);
    once they run out, every answer is the canned text. input_tokens: the prompt size the canned
    answers report, fixed or computed from the request body (to see what the client does when it
    believes its conversation has reached a given size). error: given a request body, a
    (status, JSON) to answer with instead, or None.
    """

    def __init__(
        self,
        replies: list | None = None,
        input_tokens: int | Callable[[dict], int] = 10,
        text: str = "hi there",
        error: Callable[[dict], tuple[int, dict] | None] | None = None,
    ) -> None:
        self.requests: list[dict] = []
        self.replies = list(replies or [])
        self.input_tokens = input_tokens
        self.text = text
        self.error = error
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def _record(self) -> dict:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                entry = {
                    "method": self.command,
                    "path": self.path,
                    "headers": {k.lower(): v for k, v in self.headers.items()},
                    "body": body,
                }
                recorder.requests.append(entry)
                return entry

            def do_HEAD(self) -> None:
                self._record()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                self._record()
                self._json(404, {"type": "error", "error": {"type": "not_found_error", "message": "no"}})

            def do_POST(self) -> None:
                entry = self._record()
                if self.path.split("?")[0].endswith("/v1/messages"):
                    model = (entry["body"] or {}).get("model", "?")
                    failure = recorder.error(entry["body"] or {}) if recorder.error else None
                    if failure is not None:
                        self._json(*failure)
                        return
                    reported = recorder.input_tokens
                    if callable(reported):
                        reported = reported(entry["body"] or {})
                    if (entry["body"] or {}).get("stream"):
                        if recorder.replies:
                            payload = recorder.replies.pop(0)(model)
                        else:
                            payload = canned_stream(model, recorder.text, reported)
                        self.send_response(200)
                        self.send_header("Content-Type", "text/event-stream")
                        self.send_header("Content-Length", str(len(payload)))
                        self.end_headers()
                        self.wfile.write(payload)
                        return
                    self._json(
                        200,
                        {
                            "id": "msg_rec",
                            "type": "message",
                            "role": "assistant",
                            "model": model,
                            "content": [{"type": "text", "text": recorder.text}],
                            "stop_reason": "end_turn",
                            "stop_sequence": None,
                            "usage": {"input_tokens": reported, "output_tokens": 3},
                        },
                    )
                    return
                self._json(404, {"type": "error", "error": {"type": "not_found_error", "message": "no"}})

            def _json(self, status: int, data: dict) -> None:
                payload = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Recorder:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
