"""kind = "openai" against an independent server: llama.cpp's OpenAI-compatible server
(`llama-cpp-python[server]`) on the default model's GGUF, on 127.0.0.1, through the translation:
plain answers, streaming, tools (forced tool choice, streamed argument deltas), tool results.

Needs `pip install 'llama-cpp-python[server]'` (compiles llama.cpp; not part of CI's install).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import anthropic
import httpx
import pytest

from tests.test_upstream_support import FRONT_TOKEN, front_records, front_server

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow, pytest.mark.model]
llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install 'llama-cpp-python[server]')"
)
pytest.importorskip("llama_cpp.server", reason="llama-cpp-python was installed without the [server] extra")

READ = {
    "name": "Read",
    "description": "Read a file from the repository",
    "input_schema": {
        "type": "object",
        "properties": {"file_path": {"type": "string"}},
        "required": ["file_path"],
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_server():
    from ikcode.model.default_model import default_model_path

    port = _free_port()
    command = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(default_model_path()),
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--n_threads", "2",
        "--chat_format", "chatml-function-calling", "--model_alias", "smollm2",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/models", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"llama_cpp.server did not start: {process.stderr.read().decode()[-2000:]}")
        time.sleep(0.5)
    yield url
    process.terminate()
    process.wait(30)


@pytest.fixture(scope="module")
def front_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("front-llamacpp")


@pytest.fixture(scope="module")
def sdk(llama_server, front_dir):
    srv = front_server(
        front_dir,
        "openai",
        [llama_server],
        token=None,
        served_model="smollm2",
        context_window=4096,
        model="smollm2",
    )
    yield anthropic.Anthropic(base_url=srv.url, api_key=FRONT_TOKEN, max_retries=0)
    srv.stop()


def test_plain_and_streamed_answers(sdk, front_dir):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    answer = sdk.messages.create(
        model="smollm2", max_tokens=16, system="Be brief.", messages=messages, temperature=0
    )
    assert answer.content[0].type == "text" and "paris" in answer.content[0].text.lower()
    assert answer.usage.input_tokens > 10 and answer.usage.output_tokens > 0
    assert answer.stop_reason in ("end_turn", "max_tokens")
    with sdk.messages.stream(model="smollm2", max_tokens=8, messages=messages, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and "content_block_delta" in kinds and kinds[-1] == "message_stop"
    assert final.content[0].text and final.usage.output_tokens > 0
    record = front_records(front_dir)[-1]
    assert record["ttft_source"] == "measured_by_ikcode" and record["ttft_ms"] > 0
    assert record["cache_source"] in ("reported_by_upstream", "not_reported_by_upstream")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_then_tool_result(sdk, stream):
    messages = [{"role": "user", "content": "Show me the file /repo/README.md"}]
    kwargs = dict(model="smollm2", max_tokens=64, tools=[READ], tool_choice={"type": "tool", "name": "Read"})
    if stream:
        with sdk.messages.stream(messages=messages, **kwargs) as s:
            deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
            reply = s.get_final_message()
        assert "input_json_delta" in deltas
    else:
        reply = sdk.messages.create(messages=messages, **kwargs)
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert calls and calls[0].name == "Read" and isinstance(calls[0].input, dict)
    assert reply.stop_reason == "tool_use"
    follow = messages + [
        {"role": "assistant", "content": [c.model_dump() for c in reply.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "# Repo\nA demo."}],
        },
        {"role": "system", "content": "Mid-conversation context: keep answers short."},
    ]
    answer = sdk.messages.create(model="smollm2", max_tokens=16, messages=follow, tools=[READ])
    assert answer.type == "message" and answer.usage.input_tokens > 0


def test_errors_in_anthropic_shape(sdk):
    too_long = [{"role": "user", "content": "word " * 6000}]
    with pytest.raises(anthropic.BadRequestError) as info:
        sdk.messages.create(model="smollm2", max_tokens=8, messages=too_long)
    assert info.value.body["type"] == "error"
    assert json.dumps(info.value.body["error"]["type"]) == '"invalid_request_error"'
