"""What the renderer keeps of each conversation is bounded by the memory it holds, not only by
its tokens: an image in a tool result renders as a placeholder of a few tokens but keeps its
base64 for as long as the render is kept. Real server over HTTP, tiny engine."""

from __future__ import annotations

import base64
import json
import os

import httpx

from ikcode.gateway import GatewaySettings, create_app
from ikcode.gateway.server import BackgroundServer
from tests.test_gateway_support import tiny_tokenizer
from tests.tiny_model import tiny_engine

MODEL = "tiny"
IMAGE = base64.b64encode(os.urandom(450_000)).decode()  # 600 KB of base64, under the body limit


def screenshot_turn(session: int) -> dict:
    return {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [
            {"role": "user", "content": f"look at screen {session}"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": IMAGE}},
            ]}]},
        ],
        "tools": [{"name": "Read", "description": "read", "input_schema": {"type": "object"}}],
    }  # fmt: skip


def test_kept_renders_are_charged_their_requests_bytes():
    engine = tiny_engine(kv_memory_bytes=2 * 1024 * 1024)
    app = create_app(engine, tiny_tokenizer(), GatewaySettings(served_model=MODEL, default_temperature=0.0))
    store = app.state.gateway.renderer.store
    store.max_render_tokens = 1_000_000  # 4 MB of requests at 4 bytes a token
    server = BackgroundServer(app).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for session in range(12):  # a new session id per request: a new conversation each
                answer = client.post(
                    "/v1/messages",
                    json=screenshot_turn(session),
                    headers={"x-claude-code-session-id": f"s{session}"},
                )
                assert answer.status_code == 200, answer.text
    finally:
        server.stop()
        engine.shutdown(drain_timeout_s=1)
    conversations, charged = store.render_stats()
    # 12 x 600 KB were sent; the store keeps what fits in its budget: 6 or fewer, not all 12.
    assert conversations <= 6, (conversations, charged)
    assert charged <= store.max_render_tokens


def test_kept_conversations_are_counted():
    from ikcode.gateway.conversation_store import ConversationStore
    from ikcode.gateway.previous_render import PreviousRender

    store = ConversationStore(max_conversations=3)
    for n in range(10):
        store.put_render(("salt", f"s{n}"), PreviousRender(b"", 0, [], [1, 2, 3], [], [], [], []))
    assert store.render_stats() == (3, 9)
    assert store.previous_renders(("salt", "s9")) and not store.previous_renders(("salt", "s0"))


def agent_turn(agent: int, step: int) -> dict:
    """Agent `agent`'s conversation after `step` tool rounds: each round adds ~450 tokens."""
    messages: list[dict] = [{"role": "user", "content": f"agent {agent}: fix the build"}]
    for n in range(step + 1):
        tool_id = f"t{agent}x{n}"
        messages.append(
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": tool_id, "name": "Read", "input": {}}],
            }
        )
        result = f"agent {agent} file {n}: " + " ".join(f"w{agent}_{n}_{k}" for k in range(40))
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": result}]}
        )
    return {
        "model": MODEL,
        "max_tokens": 1,
        "messages": messages,
        "tools": [{"name": "Read", "description": "read", "input_schema": {"type": "object"}}],
    }


def reused_tokens_of_agents_taking_turns(tmp_path, agents: int, memory_tokens: int | None) -> list[int]:
    """Agents take turns in round robin (as a team's agents do); the render_reused_tokens the
    request log records for each agent's second turn."""
    engine = tiny_engine(kv_memory_bytes=2 * 1024 * 1024)
    log = tmp_path / f"requests-{memory_tokens}.jsonl"
    settings = GatewaySettings(
        served_model=MODEL, default_temperature=0.0, request_log_path=log,
        conversation_memory_tokens=memory_tokens,
    )  # fmt: skip
    server = BackgroundServer(create_app(engine, tiny_tokenizer(), settings)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for step in range(2):
                for agent in range(agents):
                    answer = client.post(
                        "/v1/messages",
                        json=agent_turn(agent, step),
                        headers={"x-claude-code-session-id": f"agent-{agent}"},
                    )
                    assert answer.status_code == 200, answer.text
    finally:
        server.stop()
        engine.shutdown(drain_timeout_s=1)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [r["render_reused_tokens"] for r in records[agents:]]


def test_a_gateway_remembers_as_many_conversations_as_its_memory_is_sized_for(tmp_path):
    agents = 6
    # Sized for all six: every second turn takes its earlier turns from the previous render.
    reused = reused_tokens_of_agents_taking_turns(tmp_path, agents, memory_tokens=100_000)
    assert len(reused) == agents and all(n > 0 for n in reused), reused
    # Sized for about two: round robin forgets each conversation before its agent comes back,
    # and each second turn is tokenized whole (what 100 agents of 450K met in a 4M-token store).
    reused = reused_tokens_of_agents_taking_turns(tmp_path, agents, memory_tokens=1_000)
    assert reused == [0] * agents, reused


def test_the_default_memory_holds_at_least_what_the_engine_caches():
    from ikcode.engines.placement import engine_kv_tokens
    from ikcode.gateway.conversation_store import DEFAULT_MEMORY_TOKENS, memory_tokens_for

    assert memory_tokens_for(None, 51_000_000) == 51_000_000  # 4x B200: ~51M tokens of KV
    assert memory_tokens_for(None, 4096) == DEFAULT_MEMORY_TOKENS
    assert memory_tokens_for(123, 51_000_000) == 123
    engine = tiny_engine(kv_memory_bytes=2 * 1024 * 1024)
    try:
        load = engine.load()
        assert engine_kv_tokens(engine) == load.kv_blocks_total * engine.info.block_size > 0
        app = create_app(engine, tiny_tokenizer(), GatewaySettings(served_model=MODEL))
        gateway = app.state.gateway
        assert gateway.renderer.store.max_render_tokens == DEFAULT_MEMORY_TOKENS
        assert gateway.sessions.max_tokens == DEFAULT_MEMORY_TOKENS
        app = create_app(
            engine, tiny_tokenizer(), GatewaySettings(served_model=MODEL, conversation_memory_tokens=10**8)
        )
        assert app.state.gateway.renderer.store.max_render_tokens == 10**8
        assert app.state.gateway.sessions.max_tokens == 10**8
    finally:
        engine.shutdown(drain_timeout_s=1)
