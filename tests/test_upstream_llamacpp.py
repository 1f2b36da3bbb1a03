"""kind = "openai" against an independent server: llama.cpp's OpenAI-compatible server
(`llama-cpp-python[server]`) on the default model's GGUF, on 127.0.0.1, through the translation:
plain answers, streaming, tools (forced tool choice, streamed argument deltas), tool results.

Needs `pip install 'llama-cpp-python[server]'` (compiles llama.cpp); scripts/test.sh installs it.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import pytest

from ikcode.auth import user_session
from ikcode.gateway import BackgroundServer
from tests.test_upstream_support import FRONT_TOKEN, front_app, front_records, front_server

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow, pytest.mark.model]
# Where llama-cpp-python cannot run here, skip, saying why. The check runs in a child process:
# a wheel compiled on another CPU (pip caches built wheels) dies of SIGILL when llama.cpp first
# computes, which would take this test process down with it.
PROBE = """
import llama_cpp.server
from ikcode.model.default_model import default_model_path
llama = llama_cpp.Llama(model_path=str(default_model_path()), n_ctx=64, n_threads=1, verbose=False)
llama.create_completion("Hi", max_tokens=1)
"""
_probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
if _probe.returncode == -signal.SIGILL:
    pytest.skip(
        "llama-cpp-python's compiled llama.cpp uses instructions this CPU lacks (SIGILL): a wheel "
        "built on another machine, e.g. from pip's cache. Rebuild it portable: CMAKE_ARGS="
        "'-DGGML_NATIVE=OFF' pip install --no-cache-dir --force-reinstall 'llama-cpp-python[server]' "
        "(scripts/test.sh does this by itself)",
        allow_module_level=True,
    )
if _probe.returncode != 0 and ("ImportError" in _probe.stderr or "ModuleNotFoundError" in _probe.stderr):
    pytest.skip(
        f"llama-cpp-python[server] cannot run here ({_probe.stderr.strip().splitlines()[-1:]}); "
        "install it with: pip install 'llama-cpp-python[server]'",
        allow_module_level=True,
    )

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
def llama_server(tmp_path_factory):
    from ikcode.model.default_model import default_model_path

    port = _free_port()
    command = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(default_model_path()),
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--n_threads", "2",
        "--chat_format", "chatml-function-calling", "--model_alias", "smollm2", "--verbose", "False",
    ]  # fmt: skip
    # The server's log goes to a file: llama.cpp writes ~200 KB while loading, and a pipe nobody
    # reads fills at 64 KB and blocks the server before it ever answers.
    log_path = tmp_path_factory.mktemp("llama-server") / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
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
            process.wait(10)
            pytest.fail(f"llama_cpp.server did not start: {log_path.read_text(errors='replace')[-2000:]}")
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


GREEDY = {"temperature": 0}  # this SDK version has no temperature argument; the API takes it


def test_plain_and_streamed_answers(sdk, front_dir):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    answer = sdk.messages.create(
        model="smollm2", max_tokens=16, system="Be brief.", messages=messages, extra_body=GREEDY
    )
    assert answer.content[0].type == "text" and "paris" in answer.content[0].text.lower()
    assert answer.usage.input_tokens > 10 and answer.usage.output_tokens > 0
    assert answer.stop_reason in ("end_turn", "max_tokens")
    with sdk.messages.stream(model="smollm2", max_tokens=8, messages=messages, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and "content_block_delta" in kinds and kinds[-1] == "message_stop"
    assert final.content[0].text and final.stop_reason in ("end_turn", "max_tokens")
    record = front_records(front_dir)[-1]
    assert record["ttft_source"] == "measured_by_ikcode" and record["ttft_ms"] > 0
    # llama-cpp-python ignores stream_options.include_usage and reports no cache: output tokens
    # are counted from the streamed chunks, and the cache is "not reported", never a made-up miss.
    assert record["usage_source"] == "counted_by_ikcode"
    assert final.usage.output_tokens == record["output_tokens"] > 0
    assert record["cache_source"] == "not_reported_by_upstream" and record["cached_tokens"] is None
    with sdk.messages.stream(
        model="smollm2", max_tokens=3, messages=messages, stop_sequences=["zzz"], extra_body=GREEDY
    ) as stream:
        assert stream.get_final_message().stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_then_tool_result(sdk, stream):
    messages = [{"role": "user", "content": "Show me the file /repo/README.md"}]
    kwargs = dict(model="smollm2", max_tokens=64, tools=[READ], tool_choice={"type": "tool", "name": "Read"})
    if stream:
        # Raw events, not the SDK's accumulator: a 135M model's arguments cut at max_tokens are not
        # always valid JSON, and the relay passes them on as the model wrote them.
        events = list(sdk.messages.create(messages=messages, stream=True, **kwargs))
        starts = [e.content_block for e in events if e.type == "content_block_start"]
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert [e.type for e in events][0] == "message_start" and events[-1].type == "message_stop"
        assert starts and starts[0].type == "tool_use" and starts[0].name == "Read"
        assert deltas and all(d.type == "input_json_delta" for d in deltas)
        stop = [e.delta.stop_reason for e in events if e.type == "message_delta"]
        assert stop == ["tool_use"]
        call = {"type": "tool_use", "id": starts[0].id, "name": "Read", "input": {"file_path": "README.md"}}
        reply_content = [call]
        calls = starts
    else:
        reply = sdk.messages.create(messages=messages, **kwargs)
        calls = [b for b in reply.content if b.type == "tool_use"]
        assert calls and calls[0].name == "Read" and isinstance(calls[0].input, dict)
        assert reply.stop_reason == "tool_use"
        reply_content = [c.model_dump() for c in reply.content]
    follow = messages + [
        {"role": "assistant", "content": reply_content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "# Repo\nA demo."}],
        },
        {"role": "system", "content": "Mid-conversation context: keep answers short."},
    ]
    answer = sdk.messages.create(model="smollm2", max_tokens=16, messages=follow, tools=[READ])
    assert answer.type == "message" and answer.usage.input_tokens > 0
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The same history (tool_use, tool_result, mid-conversation system) streamed back.
    events = list(
        sdk.messages.create(model="smollm2", max_tokens=16, messages=follow, tools=[READ], stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    stops = [e.delta.stop_reason for e in events if e.type == "message_delta"]
    assert len(stops) == 1 and stops[0] in ("end_turn", "max_tokens", "tool_use")


def test_errors_in_anthropic_shape(sdk):
    too_long = [{"role": "user", "content": "word " * 6000}]
    with pytest.raises(anthropic.BadRequestError) as info:
        sdk.messages.create(model="smollm2", max_tokens=8, messages=too_long)
    assert info.value.body["type"] == "error"
    assert json.dumps(info.value.body["error"]["type"]) == '"invalid_request_error"'


def test_a_stream_the_server_cuts_short_is_a_retryable_error(sdk):
    """llama-cpp-python (interrupt_requests, its default) ends a running stream with [DONE] and no
    finish reason when another request arrives: the client must see a retryable error, never a
    clean end_turn with a truncated answer."""
    prompt = [{"role": "user", "content": "Write a long story about a dragon."}]
    other: list[threading.Thread] = []
    with pytest.raises(anthropic.APIStatusError) as info:
        for event in sdk.messages.create(model="smollm2", max_tokens=256, messages=prompt, stream=True):
            if event.type == "content_block_delta" and not other:
                second = dict(model="smollm2", max_tokens=1, messages=prompt)
                other.append(threading.Thread(target=sdk.messages.create, kwargs=second))
                other[0].start()
    other[0].join(60)
    assert info.value.body["error"]["type"] == "overloaded_error"


def test_each_user_has_a_cache_salt_of_their_own(llama_server, tmp_path):
    """With several users the front sends each one's cache namespace as `cache_salt` (vLLM keys
    its prefix cache by it); llama.cpp, which does not know the field, still answers."""
    users = {"alice": FRONT_TOKEN, "bob": "bob-token"}
    app = front_app(
        tmp_path, "openai", [llama_server], token=None, served_model="smollm2", context_window=4096,
        model="smollm2", settings={"auth_tokens": users},
    )  # fmt: skip
    sent: list[dict] = []

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    app.state.upstream.client = httpx.AsyncClient(timeout=120, event_hooks={"request": [record]})
    srv = BackgroundServer(app).start()
    try:
        body = {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for token in users.values():  # the same session id from both: each keeps its own
            headers = {"x-api-key": token, "x-claude-code-session-id": "s-1"}
            answer = httpx.post(srv.url + "/v1/messages", json=body, headers=headers, timeout=120)
            assert answer.status_code == 200, answer.text
        salts = [chat.get("cache_salt") for chat in sent]
        assert len(salts) == 2 and all(salts) and salts[0] != salts[1]
        assert not any(name in salt for salt in salts for name in users)  # no user name upstream
        # Routing and admission remember a session within its user's namespace: one user who
        # learns another's session id neither moves that session nor resets its admission memory.
        up = app.state.upstream
        own = sorted(user_session(name, "s-1") for name in users)
        assert sorted(up.router.session_replica) == own and len(own) == 2
        assert sorted(up.admission.sessions) == own
    finally:
        srv.stop()
