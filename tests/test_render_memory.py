"""What the renderer keeps of each conversation is bounded by the memory it holds, not only by
its tokens: an image in a tool result renders as a placeholder of a few tokens but keeps its
base64 for as long as the render is kept. Real server over HTTP, tiny engine."""

from __future__ import annotations

import base64
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
