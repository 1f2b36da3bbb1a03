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
