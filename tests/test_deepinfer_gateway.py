"""The gateway and the admission layer, unchanged, over the DeepInfer adapter on DeepInfer's real
engine core (two rank processes on the CPU, tests/deepinfer_build/): the official SDK on real HTTP
at 127.0.0.1, streaming and not, a Claude Code shaped conversation per rank; its second turn
reads >= 95% of the first turn and its reply from cache."""

from __future__ import annotations

import copy
import random

import anthropic
import httpx
import pytest

from ikcode.admission import AdmissionConfig, AdmissionController
from ikcode.gateway import BackgroundServer, GatewaySettings, create_app
from ikcode.gateway.claude_code_shape import claude_code_request, with_turn
from tests.deepinfer_build.harness import real_engine, wait_quiet
from tests.test_gateway_support import tiny_tokenizer

pytestmark = pytest.mark.deepinfer

SCALE = 0.2  # ~18K tokens of system + tools with the byte-level test vocabulary


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    vocab = tiny_tokenizer().vocab_size
    engine = real_engine(tmp_path_factory.mktemp("di"), ranks=2, blocks=640, vocab=vocab, eos=2)
    yield engine
    engine.shutdown(drain_timeout_s=5)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    controller = AdmissionController(engine, AdmissionConfig())
    controller.start()
    settings = GatewaySettings(
        served_model="deepseek-v4.1-flash", model_aliases=("claude-opus-4-8",), default_temperature=0.0,
        request_log_path=tmp_path_factory.mktemp("gw") / "requests.jsonl",
    )  # fmt: skip
    srv = BackgroundServer(create_app(controller, tiny_tokenizer(), settings)).start()
    yield srv
    srv.stop()


def stream_call(client: anthropic.Anthropic, request: dict, session: str):
    body = copy.deepcopy(request)
    body.pop("stream")
    body["max_tokens"] = 24
    extra = {"context_management": body.pop("context_management")}
    with client.messages.stream(
        **body, extra_body=extra, extra_headers={"X-Claude-Code-Session-Id": session}
    ) as stream:
        return stream.get_final_message()


def tool_output(seed: int) -> str:
    rng = random.Random(seed)
    lines = [f"src/m{rng.randrange(999)}.py:{rng.randrange(400)}: def f{i}(x): return x" for i in range(30)]
    return "\n".join(lines)


@pytest.mark.slow
def test_claude_code_conversation_hits_on_the_second_turn(engine, server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    for seed, session in enumerate(("sess-a", "sess-b")):  # two conversations: one per rank
        request = claude_code_request(scale=SCALE, billing_hex="3f9", seed=seed)
        request["messages"][-1]["content"][-1]["text"] += f" ({session})"
        first = stream_call(client, request, session)
        first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
        wait_quiet(engine)  # the first turn is committed when DeepInfer frees it
        echoed = [block.model_dump(exclude_none=True) for block in first.content]
        for block in echoed:
            block.pop("citations", None)
        result = {"type": "tool_result", "tool_use_id": "toolu_01", "content": tool_output(1)}
        second_request = with_turn(request, echoed, [{"type": "text", "text": "Here is grep:"}, result])
        second = stream_call(client, second_request, session)
        reused = first_prompt + first.usage.output_tokens
        assert second.usage.cache_read_input_tokens >= 0.95 * reused, (second.usage, reused)
        wait_quiet(engine)
    served = [c["rank"] for c in wait_quiet(engine) if c["forward_tokens"]]
    assert served == [0, 1]


def test_sdk_without_streaming(engine, server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    message = client.messages.create(
        model="claude-opus-4-8", max_tokens=12, messages=[{"role": "user", "content": "hello, deepinfer"}]
    )
    assert message.stop_reason in ("max_tokens", "end_turn") and message.usage.output_tokens >= 1
    assert message.content and message.content[0].type == "text"
    wait_quiet(engine)


def test_metrics_and_errors_through_the_gateway(engine, server):
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert "ikcode_cache_prefix_cache_queries_total" in metrics
    messages = [{"role": "user", "content": "a " * 40000}]
    too_long = {"model": "claude-opus-4-8", "max_tokens": 10, "messages": messages}
    response = httpx.post(server.url + "/v1/messages", json=too_long, timeout=30)
    assert response.status_code == 400 and "prompt is too long" in response.json()["error"]["message"]
    wait_quiet(engine)
