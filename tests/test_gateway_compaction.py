"""Claude Code's compaction (summary) requests: told apart from ordinary turns, their output
capped, their cost (tokens, TTFT, cache served) in the request log, /health and `ikcode status`."""

# ruff: noqa: F811 (the pytest fixtures imported from test_gateway_api_support are test arguments)
from __future__ import annotations

import dataclasses
import json

import httpx

from ikcode.gateway.compaction import is_summary_request
from tests.test_gateway_api_support import TOKENS, engine, post, serve, tokenizer  # noqa: F401
from tests.test_gateway_support import wait_idle

# The opening of the request Claude Code 2.1.197 and 2.1.332 append to the conversation.
SUMMARY = (
    "Your task is to create a detailed summary of the conversation so far, paying close attention "
    "to the user's explicit requests and your previous actions."
)
TURNS = [
    {"role": "user", "content": "hello there, please read a.py and tell me what it does " * 8},
    {"role": "assistant", "content": [{"type": "text", "text": "It prints a greeting."}]},
]


class NeverStops:
    """The real engine, but no answer ends before its max_tokens (so a cap is what ends it)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, request):
        sampling = dataclasses.replace(request.sampling, ignore_eos=True, stop_token_ids=())
        return self.inner.submit(dataclasses.replace(request, sampling=sampling))


def test_summary_request_shapes():
    as_blocks = {"role": "user", "content": [{"type": "text", "text": SUMMARY}]}
    assert is_summary_request({"messages": [*TURNS, {"role": "user", "content": SUMMARY}]})
    assert is_summary_request({"messages": [*TURNS, as_blocks]})
    # Only the last user message counts: a user quoting the text earlier is an ordinary turn.
    assert not is_summary_request({"messages": [as_blocks, TURNS[1], {"role": "user", "content": "thanks"}]})
    assert not is_summary_request({"messages": TURNS[:1]})
    assert not is_summary_request({})


def test_compaction_is_capped_logged_and_counted(engine, tokenizer, tmp_path):
    server = serve(NeverStops(engine), tokenizer, tmp_path, summary_max_tokens=4)
    try:
        ordinary = {"model": "tiny", "max_tokens": 40, "messages": TURNS[:1]}
        assert post(server, ordinary).status_code == 200
        wait_idle(engine)
        body = {
            "model": "tiny",
            "max_tokens": 200,
            "messages": [*TURNS, {"role": "user", "content": SUMMARY}],
        }
        reply = post(server, body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["output_tokens"] == 4
        # Cut by the server's cap, the summary is still final: no "max_tokens" for the client to
        # continue from.
        assert reply.json()["stop_reason"] == "end_turn"
        wait_idle(engine)
        auth = {"Authorization": f"Bearer {TOKENS['alice']}"}  # the figures are for token holders
        health = httpx.get(server.url + "/health", headers=auth, timeout=10).json()
        log = server.server.config.app.state.gateway.settings.request_log_path
        lines = [json.loads(line) for line in log.read_text().splitlines()]
    finally:
        server.stop()
    first, summary = lines[-2], lines[-1]
    assert "compaction" not in first
    assert summary["compaction"] is True and summary["summary_max_tokens"] == 4
    assert summary["output_tokens"] == 4 and summary["ttft_ms"] is not None
    # The conversation before the summary request was read from the cache.
    assert summary["cached_tokens_device"] >= 16
    assert health["compactions"] == 1
    assert health["compaction_prompt_tokens"] == summary["prompt_tokens"]
    assert (
        health["compaction_cached_tokens"] == summary["cached_tokens_device"] + summary["cached_tokens_host"]
    )
    assert health["last_compaction_ttft_ms"] == summary["ttft_ms"]


def test_a_summary_cut_by_the_window_is_final_and_a_refused_one_is_logged(engine, tokenizer, tmp_path):
    """Near the window the room left, not summary_max_tokens, ends the summary: still "end_turn"
    (with "max_tokens" Claude Code asks it to go on, re-reading the conversation, then fails the
    turn). A summary request past the window is refused and still logged as a compaction."""
    cap = 100
    server = serve(NeverStops(engine), tokenizer, tmp_path, summary_max_tokens=cap)
    window = server.server.config.app.state.gateway.context_window
    try:

        def summary_of(words: int) -> dict:
            said = " ".join(f"w{i}" for i in range(words))
            messages = [{"role": "user", "content": said}, TURNS[1], {"role": "user", "content": SUMMARY}]
            return {"model": "tiny", "max_tokens": 200, "messages": messages}

        def prompt_tokens(body: dict) -> int:
            return post(server, body, path="/v1/messages/count_tokens").json()["input_tokens"]

        words = 10
        while prompt_tokens(summary_of(words)) < window - cap // 2:  # less room than the cap
            words += 10
        near, too_long = summary_of(words), summary_of(words + window)
        assert window - cap < prompt_tokens(near) < window
        reply = post(server, near)
        assert reply.status_code == 200, reply.text
        assert reply.json()["stop_reason"] == "end_turn"
        assert reply.json()["usage"]["output_tokens"] == window - prompt_tokens(near)
        assert post(server, too_long).status_code == 400
        wait_idle(engine)
        log = server.server.config.app.state.gateway.settings.request_log_path
        near_line, refused_line = [json.loads(line) for line in log.read_text().splitlines()][-2:]
    finally:
        server.stop()
    assert near_line["compaction"] is True and near_line["summary_max_tokens"] < cap
    assert refused_line["compaction"] is True and refused_line["status"] == 400
