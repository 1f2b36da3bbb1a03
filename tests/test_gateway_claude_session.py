"""Request shapes recorded from the real Claude Code client (tests/data/claude-session.json).

The session (recorded by tests/data/capture_claude_session.py): the model loads the deferred
WebFetch tool through ToolSearch, reads a file and answers; then a second turn with --continue.
What it holds that synthetic shapes did not: a `DeferredToolPlaceholder` tool and, once loaded,
WebFetch with `defer_loading: true`; a tool_result whose content is a `tool_reference` block;
`thinking: {"type": "adaptive", "display": "omitted"}`, `output_config.effort`,
`context_management.edits`; mid-conversation system messages sent as text blocks (with the
cache marker) in one request and as a plain string in the next.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from ikcode.gateway import BackgroundServer, GatewaySettings, create_app
from ikcode.gateway.render import Renderer
from ikcode.gateway.schemas import MessagesRequest
from tests.test_gateway_support import tiny_tokenizer
from tests.tiny_model import tiny_config, tiny_state_dict

SESSION = json.loads((Path(__file__).parent / "data" / "claude-session.json").read_text())
REQUESTS = [entry["body"] for entry in SESSION["requests"]]
WEBFETCH = next(t for t in REQUESTS[-1]["tools"] if t["name"] == "WebFetch")


def render(renderer: Renderer, body: dict):
    request = MessagesRequest.model_validate(body)
    return renderer.render(request.system, request.tools, request.tool_choice, request.messages)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def test_the_recording_holds_the_new_shapes():
    assert SESSION["client"].startswith("2.1."), SESSION["client"]
    betas = SESSION["requests"][0]["anthropic_beta"].split(",")
    assert "advanced-tool-use-2025-11-20" in betas
    first = REQUESTS[0]
    assert first["thinking"] == {"type": "adaptive", "display": "omitted"}
    assert first["output_config"] == {"effort": "high"}
    assert first["context_management"]["edits"]
    assert any(t.get("defer_loading") for t in first["tools"])
    assert "ToolSearch" in [t["name"] for t in first["tools"]]
    results = [
        block
        for message in REQUESTS[1]["messages"]
        if isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]
    assert {"type": "tool_reference", "tool_name": "WebFetch"} in results[0]["content"]
    system_turns = [m for m in REQUESTS[0]["messages"] if m["role"] == "system"]
    assert isinstance(system_turns[0]["content"], list)
    resent = [m for m in REQUESTS[1]["messages"] if m["role"] == "system"][0]
    assert resent["content"] == system_turns[0]["content"][0]["text"]  # the same text, as a string


def test_each_request_starts_with_the_previous_one_byte_for_byte(tokenizer):
    """Rendered afresh (no store), each request's prompt is the previous prompt plus new turns:
    the resent content, including the system message whose shape changed, renders the same."""
    previous = None
    for body in REQUESTS:
        ids = render(Renderer(tokenizer), body).token_ids
        if previous is not None:
            assert ids[: len(previous)] == previous, "a resent turn rendered differently"
            assert len(ids) > len(previous)
        previous = ids


def test_deferred_tools_stay_out_of_the_prompt_until_loaded(tokenizer):
    before = tokenizer.decode(render(Renderer(tokenizer), REQUESTS[0]).token_ids)
    assert "DeferredToolPlaceholder" not in before
    assert WEBFETCH["description"][:60] not in before
    assert '"name": "ToolSearch"' in before  # the tools it is sent with are there
    for body in REQUESTS[1:]:
        text = tokenizer.decode(render(Renderer(tokenizer), body).token_ids)
        assert "DeferredToolPlaceholder" not in text
        loaded = text.index('<function>{"description": ' + json.dumps(WEBFETCH["description"])[:60])
        # Where ToolSearch's result loaded it, after the tool list and the first user turn.
        assert loaded > text.index("<tool_response>") > text.index("Load the web fetch tool")
        assert text.count(WEBFETCH["description"][:60]) == 1


def test_the_gateway_accepts_every_recorded_request(tokenizer, tmp_path):
    """Over HTTP, with the client's headers: validated and rendered (count_tokens), no 400."""
    cfg = tiny_config(max_position_embeddings=65536)
    engine = EmbeddedEngine(
        cfg, tiny_state_dict(cfg), EmbeddedEngineConfig(kv_memory_bytes=4 * 1024 * 1024, num_threads=1)
    )
    settings_ = GatewaySettings(served_model="smollm2-135m-instruct", request_log_path=tmp_path / "r.jsonl")
    srv = BackgroundServer(create_app(engine, tokenizer, settings_)).start()
    try:
        counts = []
        for entry in SESSION["requests"]:
            body = {k: v for k, v in entry["body"].items() if k not in ("stream", "max_tokens", "metadata")}
            response = httpx.post(
                f"{srv.url}/v1/messages/count_tokens?beta=true",
                json=body,
                headers={"anthropic-version": "2023-06-01", "anthropic-beta": entry["anthropic_beta"]},
                timeout=60,
            )
            assert response.status_code == 200, response.text
            counts.append(response.json()["input_tokens"])
        assert counts == sorted(counts)
    finally:
        srv.stop()


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=80)


@settings(max_examples=60, deadline=None)
@given(before=_text, system=_text, after=_text, marker=st.booleans())
def test_system_message_as_blocks_or_string_renders_the_same_tokens(before, system, after, marker):
    tokenizer = tiny_tokenizer()
    block = {"type": "text", "text": system}
    if marker:
        block["cache_control"] = {"type": "ephemeral"}

    def body(content):
        messages = [
            {"role": "user", "content": before},
            {"role": "system", "content": content},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": after},
        ]
        return {"model": "m", "max_tokens": 10, "messages": messages}

    as_blocks = render(Renderer(tokenizer), body([block])).token_ids
    as_string = render(Renderer(tokenizer), body(system)).token_ids
    assert as_blocks == as_string
    # And through one renderer's store: the string form finds the blocks form's segment.
    renderer = Renderer(tokenizer)
    render(renderer, body([block]))
    again = render(renderer, body(system))
    assert again.token_ids == as_blocks
    assert again.fresh_tokens == 0
