"""The upstream front when a replica's stream is not what it should be: cut in the middle of an
event, ended cleanly before the answer is whole, a chunk the translation cannot read, thinking
before the first visible token; and a client that leaves in the middle of a stream. The replica
here is a scripted socket server: these are faults no real replica produces on demand."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.test_upstream_support import FRONT_TOKEN, front_records, front_server

BODY = {"model": "tiny", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
HEADERS = {"x-api-key": FRONT_TOKEN}


class ScriptedReplica:
    """Answers each POST with `parts` as a chunked event stream (pause_s apart), then ends the
    body properly (`clean`) or drops the connection; health checks get 200 {"data": []}."""

    def __init__(
        self, parts: list[bytes], clean: bool, pause_s: float = 0.05, answers: bool = True, raw: bytes = b""
    ):
        self.parts, self.clean, self.pause_s = parts, clean, pause_s
        self.answers = answers  # False: the connection is closed after the request, no answer
        self.raw = raw  # an answer sent as it is (status line, headers, body), then the close
        self.posts = 0
        self.bodies: list[dict] = []  # the JSON bodies received
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            received = b""
            while b"\r\n\r\n" not in received:
                received += conn.recv(65536)
            head, _, body = received.partition(b"\r\n\r\n")
            if not head.startswith(b"POST"):
                conn.sendall(
                    b'HTTP/1.1 200 OK\r\ncontent-length: 12\r\nconnection: close\r\n\r\n{"data": []}'
                )
                return
            length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            while len(body) < length:
                body += conn.recv(65536)
            self.posts += 1
            self.bodies.append(json.loads(body))
            if not self.answers:  # as a server that dies while working on it
                time.sleep(self.pause_s)
                return
            if self.raw:
                conn.sendall(self.raw)
                return
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                b"connection: close\r\n\r\n"
            )
            try:
                for part in self.parts:
                    conn.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                    time.sleep(self.pause_s)
                if self.clean:
                    conn.sendall(b"0\r\n\r\n")
            except OSError:  # the front hung up (its client left, or it had read enough)
                pass

    def close(self) -> None:
        self.listener.close()
        self.thread.join(5)


def _events(url: str, token: str = FRONT_TOKEN) -> list[dict]:
    headers = {"x-api-key": token}
    with httpx.stream("POST", url + "/v1/messages", json=BODY, headers=headers, timeout=30) as answer:
        assert answer.status_code == 200
        raw = b"".join(answer.iter_raw())
    return [json.loads(e.split(b"data: ", 1)[1]) for e in raw.split(b"\n\n") if b"data: " in e]


def _anthropic(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def _openai(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


FINISH_TOOL_CALLS = (
    _openai({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}) + b"data: [DONE]\n\n"
)
START = _anthropic("message_start", {"type": "message_start", "message": {"id": "m", "usage": {}}})
BLOCK = _anthropic(
    "content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}}
)
DELTA = _anthropic(
    "content_block_delta",
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}},
)


def test_a_replica_dying_mid_event_never_leaves_half_an_event_before_the_error(tmp_path):
    half = b'event: content_block_delta\ndata: {"type":"content_bl'
    replica = ScriptedReplica([START, half], clean=False, pause_s=0.1)
    front = front_server(tmp_path, "anthropic", [replica.url])
    try:
        with httpx.stream("POST", front.url + "/v1/messages", json=BODY, headers=HEADERS, timeout=30) as r:
            received = b"".join(r.iter_raw())
        events = [e for e in received.split(b"\n\n") if e.strip()]
        assert events[0] == START.strip()
        assert b"content_bl" not in received  # the half event was not relayed
        last = json.loads(events[-1].split(b"data: ", 1)[1])
        assert last["error"]["type"] == "overloaded_error"
        # `ikcode status` counts it as the server's error, not as an answered request.
        health = httpx.get(front.url + "/health", headers=HEADERS).json()
        assert (health["requests"], health["errors"]) == (0, 1)
    finally:
        front.stop()
        replica.close()


def test_a_stream_that_ends_cleanly_before_message_stop_ends_with_an_error(tmp_path):
    """A proxy or server that closes early with a proper end of body: the client must not take
    the cut answer for a whole one (it had no error event, and the log said answered)."""
    replica = ScriptedReplica([START, BLOCK, DELTA], clean=True)
    front = front_server(tmp_path, "anthropic", [replica.url])
    try:
        events = _events(front.url)
        assert [e["type"] for e in events] == [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "error",
        ]
        assert events[-1]["error"]["type"] == "overloaded_error"
        (record,) = front_records(tmp_path)
        assert record["error"] and "message_stop" in record["error"]
    finally:
        front.stop()
        replica.close()


def test_a_whole_anthropic_stream_is_relayed_as_it_came(tmp_path):
    stop = _anthropic("message_stop", {"type": "message_stop"})
    replica = ScriptedReplica([START, BLOCK, DELTA, stop], clean=True)
    front = front_server(tmp_path, "anthropic", [replica.url])
    try:
        assert [e["type"] for e in _events(front.url)][-1] == "message_stop"
        (record,) = front_records(tmp_path)
        assert record["error"] is None
    finally:
        front.stop()
        replica.close()


@pytest.mark.parametrize(
    "tool_calls",
    [
        [{"index": 0, "id": "c1", "function": "not an object"}],
        [{"index": 0, "id": "c1", "function": {"name": "Read", "arguments": 7}}],
    ],
    ids=["function not an object", "arguments not a string"],
)
def test_a_chunk_the_translation_cannot_read_ends_the_stream_with_an_error(tmp_path, tool_calls):
    """It raised out of the stream: the client got a broken chunked body and the log said 200."""
    chunk = _openai({"choices": [{"index": 0, "delta": {"tool_calls": tool_calls}}]})
    done = (
        _openai({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}) + b"data: [DONE]\n\n"
    )
    replica = ScriptedReplica([chunk, done], clean=True)
    front = front_server(tmp_path, "openai", [replica.url])
    try:
        events = _events(front.url)
        assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
        (record,) = front_records(tmp_path)
        assert record["error"] and record["status"] == 200
    finally:
        front.stop()
        replica.close()


def test_a_tool_call_fragment_without_an_index_goes_to_the_call_being_streamed(tmp_path):
    first = {"index": 0, "id": "c1", "type": "function", "function": {"name": "Read", "arguments": '{"path"'}}
    rest = {"index": None, "function": {"arguments": ': "a.py"}'}}
    parts = [
        _openai({"choices": [{"index": 0, "delta": {"tool_calls": [first]}}]}),
        _openai({"choices": [{"index": 0, "delta": {"tool_calls": [rest]}}]}),
        _openai({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
        + b"data: [DONE]\n\n",
    ]
    replica = ScriptedReplica(parts, clean=True)
    front = front_server(tmp_path, "openai", [replica.url])
    try:
        events = _events(front.url)
        pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
        assert json.loads("".join(pieces)) == {"path": "a.py"}
        assert [e for e in events if e["type"] == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"
    finally:
        front.stop()
        replica.close()


def test_thinking_counts_as_the_first_token(tmp_path):
    """A reasoning model's prompt is done when it starts thinking: admission (which holds a cold
    prompt's slot until its first token) and the logged TTFT go by that, not by the first
    visible word after a long think."""
    parts = [
        _openai({"choices": [{"index": 0, "delta": {"reasoning_content": "Let me think."}}]}),
        _openai({"choices": [{"index": 0, "delta": {"content": "Hello"}}]}),
        _openai({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + b"data: [DONE]\n\n",
    ]
    replica = ScriptedReplica(parts, clean=True, pause_s=1.5)
    front = front_server(tmp_path, "openai", [replica.url])
    try:
        events = _events(front.url)
        assert (
            "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
            == "Hello"
        )
        (record,) = front_records(tmp_path)
        assert record["ttft_ms"] < 1000, record["ttft_ms"]
    finally:
        front.stop()
        replica.close()


@pytest.mark.parametrize("kind", ["anthropic", "openai"])
def test_a_client_that_leaves_mid_stream_is_logged_as_gone_not_answered(tmp_path, kind):
    if kind == "anthropic":
        parts = [START, BLOCK] + [DELTA] * 20
    else:
        parts = [_openai({"choices": [{"index": 0, "delta": {"content": "word "}}]})] * 20
    replica = ScriptedReplica(parts, clean=True, pause_s=0.3)
    front = front_server(tmp_path, kind, [replica.url])
    try:
        with httpx.stream("POST", front.url + "/v1/messages", json=BODY, headers=HEADERS, timeout=30) as r:
            for line in r.iter_lines():
                if "content_block_delta" in line:
                    break  # the client leaves after its first words
        deadline = time.monotonic() + 10
        while not front_records(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        (record,) = front_records(tmp_path)
        assert record["error"] == "client disconnected", record
        health = httpx.get(front.url + "/health", headers=HEADERS).json()
        assert health["in_flight"] == 0
    finally:
        front.stop()
        replica.close()


@pytest.mark.parametrize("retries", [0, 1])
def test_a_request_a_replica_may_have_received_is_resent_at_most_retries_times(tmp_path, retries):
    """Closed after the request arrived, before any answer: the replica may have done the work,
    so a retry elsewhere may do it again. `retries = 0` had no effect (every replica was tried)."""
    replicas = [ScriptedReplica([], clean=False, pause_s=0.2, answers=False) for _ in range(3)]
    front = front_server(tmp_path, "anthropic", [r.url for r in replicas], retries=retries)
    try:
        whole = dict(BODY, stream=False)
        answer = httpx.post(front.url + "/v1/messages", json=whole, headers=HEADERS, timeout=30)
        assert answer.status_code == 503 and answer.json()["type"] == "error"
        assert sum(r.posts for r in replicas) == 1 + retries
    finally:
        front.stop()
        for replica in replicas:
            replica.close()


CUT_JSON = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"id": 1'
HTML = b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 13\r\n\r\n<html></html>"


@pytest.mark.parametrize(
    ("kind", "raw"),
    [("anthropic", CUT_JSON), ("openai", CUT_JSON), ("openai", HTML)],
    ids=["anthropic answer cut", "openai answer cut", "openai answer not JSON"],
)
def test_a_whole_answer_that_fails_is_an_error_in_the_clients_shape_and_logged(tmp_path, kind, raw):
    """They were a bare 500 "internal server error" with a traceback, and missing from the log."""
    replica = ScriptedReplica([], clean=False, raw=raw)
    front = front_server(tmp_path, kind, [replica.url])
    try:
        whole = dict(BODY, stream=False)
        answer = httpx.post(front.url + "/v1/messages", json=whole, headers=HEADERS, timeout=30)
        assert answer.status_code in (500, 529) and answer.json()["type"] == "error"
        assert "upstream" in answer.json()["error"]["message"]
        (record,) = front_records(tmp_path)
        assert record["status"] == answer.status_code and record["error"]
    finally:
        front.stop()
        replica.close()


def test_cache_salts_are_keyed_by_the_front_so_no_one_else_can_name_them(tmp_path, monkeypatch):
    """vLLM asks for a cache_salt nobody else can guess: a digest of the user name alone could be
    computed by anyone who reaches the upstream, and was the same at every front."""
    done = _openai({"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]})
    replica = ScriptedReplica([done + b"data: [DONE]\n\n"], clean=True)
    users = {"alice": FRONT_TOKEN, "bob": "ik-bob-0123456789"}

    def salts() -> list[str]:
        front = front_server(tmp_path, "openai", [replica.url], settings={"auth_tokens": users})
        try:
            for token in [*users.values(), FRONT_TOKEN]:
                _events(front.url, token)
        finally:
            front.stop()
        return [body["cache_salt"] for body in replica.bodies[-3:]]

    try:
        alice, bob, alice_again = salts()
        assert alice == alice_again != bob
        assert not any(name in salt for salt in (alice, bob) for name in users)
        monkeypatch.setenv("IKCODE_HOME", str(tmp_path / "another-front"))
        other_alice, _, _ = salts()
        assert other_alice != alice  # another front's user of the same name: another namespace
    finally:
        replica.close()


def test_tool_calls_streamed_interleaved_end_with_an_error_not_a_cut_input(tmp_path):
    """The first call's block is closed when the second starts; its late fragment was dropped and
    the client got `{"x":` as a finished call's input, with stop_reason tool_use."""

    def call(index: int, arguments: str, name: str | None = None) -> bytes:
        function = {"arguments": arguments} | ({"name": name} if name else {})
        fragment = {"index": index, "function": function} | ({"id": f"c{index}"} if name else {})
        return _openai({"choices": [{"index": 0, "delta": {"tool_calls": [fragment]}}]})

    parts = [call(0, '{"x":', "A"), call(1, '{"y":', "B"), call(0, " 1}"), call(1, " 2}"), FINISH_TOOL_CALLS]
    replica = ScriptedReplica(parts, clean=True)
    front = front_server(tmp_path, "openai", [replica.url])
    try:
        events = _events(front.url)
        assert events[-1]["type"] == "error" and "interleaved" in events[-1]["error"]["message"]
        assert not [e for e in events if e["type"] == "message_delta"]
    finally:
        front.stop()
        replica.close()


QUOTED = json.dumps(
    {"error": {"type": "invalid_request_error", "message": "bad input: [MY SECRET PROMPT sk-live-123]"}}
).encode()
QUOTING = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
    + f"content-length: {len(QUOTED)}\r\n\r\n".encode()
    + QUOTED
)


@pytest.mark.parametrize("kind", ["anthropic", "openai"])
def test_an_upstream_error_quoting_the_prompt_stays_out_of_the_log(tmp_path, kind):
    """The client gets the replica's error whole; the request log kept its message, and servers'
    validation errors quote the request back (no prompts in logs unless log_prompts)."""
    replica = ScriptedReplica([], clean=False, raw=QUOTING)
    front = front_server(tmp_path, kind, [replica.url])
    try:
        whole = dict(BODY, stream=False, model={"a": [["x"]]} if kind == "anthropic" else "tiny")
        answer = httpx.post(front.url + "/v1/messages", json=whole, headers=HEADERS, timeout=30)
        assert answer.status_code == 400 and "MY SECRET PROMPT" in answer.text
        (record,) = front_records(tmp_path)
        assert "SECRET" not in json.dumps(record) and "400" in record["error"], record
        assert record["model"] in (None, "tiny")  # a client's object is not logged as it came
    finally:
        front.stop()
        replica.close()
