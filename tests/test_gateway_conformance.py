"""The Messages API as the official SDK reads it, where the gateway's tool handling and metadata
once differed from Anthropic's: each test says what the API promises (the SDK's types cited)."""

# ruff: noqa: F811 (the pytest fixtures imported from test_gateway_api_support are test arguments)
from __future__ import annotations

import dataclasses
import threading

import anthropic
import httpx
import pytest
from anthropic.types import ModelInfo

from ikcode.engines.base import FinishReason, RequestStream
from tests.test_gateway_api_support import (  # noqa: F401 - fixtures
    HELLO,
    READ_TOOL,
    TOKENS,
    TOOL_CALL,
    client,
    engine,
    serve,
    server,
    tokenizer,
)
from tests.test_gateway_support import ScriptedEngine

WRITE_TOOL = {
    "name": "Write",
    "description": "write a file",
    "input_schema": {
        "type": "object",
        "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["file_path", "content"],
    },
}
WRITE_CALL = (
    '<tool_call>\n{"name": "Write", "arguments": {"file_path": "/repo/a.py", '
    '"content": "def f():\\n    return 1\\n"}}\n</tool_call>'
)


class CutScripted(ScriptedEngine):
    """A script longer than the request's max_tokens is cut there and ends as LENGTH, as the
    engine ends a reply at its limit."""

    def submit(self, request):
        n = min(len(self.script), request.sampling.max_tokens)
        cut = n < len(self.script)
        sampling = dataclasses.replace(request.sampling, max_tokens=n, ignore_eos=True, stop_token_ids=())
        inner = self.inner.submit(dataclasses.replace(request, sampling=sampling))
        outer = RequestStream(request.request_id, on_abort=self.inner.abort)

        def relay() -> None:
            at = 0
            for event in inner:
                ids = self.script[at : at + len(event.token_ids)]
                at += len(event.token_ids)
                reason = (FinishReason.LENGTH if cut else FinishReason.STOP) if event.finished else None
                outer.put(dataclasses.replace(event, token_ids=ids, finish_reason=reason))

        threading.Thread(target=relay, daemon=True).start()
        return outer


def _script(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text) + [tokenizer.token_to_id("<|im_end|>")]


@pytest.fixture
def two_calls(engine, tokenizer, tmp_path):
    """An SDK client whose every answer is text and then two Read calls."""
    reply = "Reading it. " + TOOL_CALL + "\n" + TOOL_CALL.replace("a.py", "b.py")
    srv = serve(ScriptedEngine(engine, _script(tokenizer, reply)), tokenizer, tmp_path)
    yield anthropic.Anthropic(base_url=srv.url, api_key=TOKENS["alice"], max_retries=0)
    srv.stop()


def _calls(message) -> list:
    return [block for block in message.content if block.type == "tool_use"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_cut_by_max_tokens_is_max_tokens(engine, tokenizer, tmp_path, stream):
    # stop_reason "max_tokens": "we exceeded the requested max_tokens" (anthropic/types/message.py);
    # "tool_use" would have the client run a Write whose content was cut off.
    srv = serve(CutScripted(engine, _script(tokenizer, "Writing. " + WRITE_CALL)), tokenizer, tmp_path)
    sdk = anthropic.Anthropic(base_url=srv.url, api_key=TOKENS["alice"], max_retries=0)
    cut_at = len(tokenizer.encode('Writing. <tool_call>\n{"name": "Write", "arguments": {"file_path": '))
    request = dict(model="tiny", max_tokens=cut_at + 12, messages=HELLO, tools=[WRITE_TOOL])
    try:
        if stream:
            with sdk.messages.stream(**request) as events:
                message = events.get_final_message()
        else:
            message = sdk.messages.create(**request)
        assert message.stop_reason == "max_tokens", (message.stop_reason, message.content)
    finally:
        srv.stop()


def test_tool_choice_none_never_answers_with_a_call(two_calls):
    # "The model will not be allowed to use tools" (anthropic/types/tool_choice_none_param.py).
    message = two_calls.messages.create(
        model="tiny", max_tokens=200, messages=HELLO, tools=[READ_TOOL], tool_choice={"type": "none"}
    )
    assert message.stop_reason == "end_turn" and _calls(message) == []
    assert "<tool_call>" in message.content[0].text  # what the model wrote stays, as text


def test_a_request_without_tools_never_gets_a_call(two_calls):
    message = two_calls.messages.create(model="tiny", max_tokens=200, messages=HELLO)
    assert message.stop_reason == "end_turn" and _calls(message) == []


@pytest.mark.parametrize("stream", [False, True])
def test_disable_parallel_tool_use_gives_at_most_one_call(two_calls, stream):
    # "the model will output at most one tool use" (anthropic/types/tool_choice_auto_param.py).
    request = dict(
        model="tiny",
        max_tokens=200,
        messages=HELLO,
        tools=[READ_TOOL],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
    )
    if stream:
        with two_calls.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = two_calls.messages.create(**request)
    assert [call.input for call in _calls(message)] == [{"file_path": "/repo/a.py"}]
    assert message.stop_reason == "tool_use"


def test_model_entries_validate_as_the_sdks_model_info(server):
    headers = {"x-api-key": TOKENS["alice"]}
    for entry in httpx.get(server.url + "/v1/models", headers=headers).json()["data"]:
        ModelInfo.model_validate(entry)  # lifecycle is required (anthropic/types/model_info.py)
    ModelInfo.model_validate(httpx.get(server.url + "/v1/models/tiny", headers=headers).json())


def test_every_answer_carries_a_request_id(client):
    # The SDK reads it as `request_id` (anthropic/_response.py, anthropic/_exceptions.py).
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=2, messages=HELLO)
    assert raw.request_id and raw.request_id.startswith("req_")
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="gpt-5", max_tokens=2, messages=HELLO)
    assert info.value.request_id and info.value.request_id != raw.request_id
