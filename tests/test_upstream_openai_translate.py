"""The Messages <-> chat completions translation, function by function (the end-to-end run against
a real OpenAI-compatible server is tests/test_upstream_llamacpp.py)."""

from __future__ import annotations

import json
import re

import pytest

from ikcode.gateway.errors import APIError
from ikcode.upstream.openai_request import to_chat_request
from ikcode.upstream.openai_response import to_anthropic_error, to_message
from ikcode.upstream.openai_stream import StreamTranslator


def test_request_keeps_order_tools_results_and_mid_conversation_system():
    body = {
        "model": "m",
        "max_tokens": 9,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc=1"},
            {"type": "text", "text": "Be exact."},
        ],
        "tools": [
            {"name": "Read", "input_schema": {"type": "object"}},
            {"name": "web", "type": "web_search_1"},
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "adaptive"},
        "messages": [
            {"role": "user", "content": "read a.py"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a.py"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "print(1)"}],
            },
            {"role": "system", "content": "context update"},
            {"role": "user", "content": [{"type": "text", "text": "and?"}]},
        ],
    }
    chat = to_chat_request(body, "served")
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "system", "user"]
    assert chat["messages"][0]["content"] == "Be exact."  # attribution line dropped
    call = chat["messages"][2]["tool_calls"][0]
    assert call["id"] == "t1" and json.loads(call["function"]["arguments"]) == {"file_path": "a.py"}
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "print(1)"}
    assert [t["function"]["name"] for t in chat["tools"]] == ["Read"]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stream_options"] == {"include_usage": True} and "thinking" not in chat


def test_response_and_errors():
    completion = {
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "content": "",
                    "tool_calls": [{"id": "c1", "function": {"name": "Read", "arguments": "{}"}}],
                },
            }
        ],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 64},
        },
    }
    message, usage = to_message(completion, "msg_1", "m", [])
    assert message["stop_reason"] == "tool_use" and message["content"][0]["name"] == "Read"
    usage_out = message["usage"]
    assert usage_out["input_tokens"] == 36 and usage_out["cache_read_input_tokens"] == 64
    text = "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens"
    raw = json.dumps({"error": {"message": text}}).encode()
    status, body = to_anthropic_error(400, raw)
    assert status == 400 and body["error"]["message"].startswith(
        "prompt is too long: 9000 tokens > 4096 maximum"
    )


# Claude Code 2.1.332 reads this exact sentence and retries with a max_tokens that fits (its own
# pattern, from the client's source); "prompt is too long" would start a needless compaction.
CLIENT_RETRY = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)")


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context "
            "length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778). None",
            ("2778", "8000", "4096"),
        ),
        (
            "This model's maximum context length is 4096 tokens. However, you requested 4300 tokens "
            "(3000 in the messages, 1300 in the completion). Please reduce the length of the messages "
            "or completion.",
            ("3000", "1300", "4096"),
        ),
        (
            "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
            "(4500 in the messages, 500 in the completion). Please reduce the length of the messages "
            "or completion.",
            None,  # the prompt alone is too long
        ),
    ],
    ids=["vllm max_tokens too large", "vllm old wording, prompt fits", "vllm old wording, prompt too long"],
)
def test_a_prompt_that_fits_without_its_max_tokens_is_said_as_anthropic_says_it(message, expected):
    status, body = to_anthropic_error(400, json.dumps({"error": {"message": message}}).encode())
    said = body["error"]["message"]
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    if expected is None:
        assert said == "prompt is too long: 4500 tokens > 4096 maximum"
    else:
        found = CLIENT_RETRY.search(said)
        assert found is not None and found.groups() == expected, said


def test_the_replicas_refusal_of_the_fronts_credentials_is_not_the_clients_auth_error():
    for refused in (401, 403):
        status, body = to_anthropic_error(refused, b'{"error": {"message": "invalid api key"}}')
        assert status == 500 and body["error"]["type"] == "api_error"
        assert "credentials" in body["error"]["message"]


def test_a_filtered_answer_is_a_refusal():
    completion = {"choices": [{"finish_reason": "content_filter", "message": {"content": ""}}], "usage": {}}
    message, _ = to_message(completion, "msg_1", "m", [])
    assert message["stop_reason"] == "refusal"


def test_stream_text_then_tool_call_deltas():
    tr = StreamTranslator("msg_1", "m", [])
    chunks = [
        {"choices": [{"delta": {"role": "assistant", "reasoning_content": "dropped"}}]},
        {"choices": [{"delta": {"content": "Let me look."}}]},
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "c1", "function": {"name": "Read", "arguments": ""}}
                        ]
                    }
                }
            ]
        },
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"file_path":'}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ' "a.py"}'}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 7}},
    ]
    out = [tr.start()] + [e for c in chunks for e in tr.feed(c)] + list(tr.finish())
    events = [json.loads(e.split(b"data: ")[1]) for e in out]
    kinds = [e["type"] for e in events]
    assert kinds == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    partial = "".join(
        e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta"
    )
    assert json.loads(partial) == {"file_path": "a.py"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["input_tokens"] == 10
    assert tr.usage_source == "reported_by_upstream" and events[-2]["usage"]["output_tokens"] == 7


def test_stream_without_usage_counts_chunks_and_llama_server_cache_report():
    tr = StreamTranslator("msg_2", "m", [])
    chunks = [{"choices": [{"delta": {"content": word}}]} for word in ("The", " capital", " is")]
    out = [e for c in chunks + [{"choices": [{"delta": {}, "finish_reason": "length"}]}] for e in tr.feed(c)]
    final = json.loads(list(tr.finish())[-2].split(b"data: ")[1])
    assert len(out) == 4 and final["delta"]["stop_reason"] == "max_tokens"
    assert final["usage"]["output_tokens"] == 3 and tr.usage_source == "counted_by_ikcode"
    # llama-server's `timings.cache_n` is its cache report when prompt_tokens_details is absent.
    completion = {
        "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 1},
        "timings": {"cache_n": 96, "prompt_n": 4},
    }
    message, usage = to_message(completion, "msg_3", "m", [])
    assert usage.cached_tokens == 96 and message["usage"]["cache_read_input_tokens"] == 96
    assert message["usage"]["input_tokens"] == 4


def test_call_only_assistant_turn_has_string_content():
    chat = to_chat_request(
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
            ],
        },
        "m",
    )
    assistant = chat["messages"][1]
    assert assistant["content"] == "" and assistant["tool_calls"][0]["id"] == "t1"


def test_the_matched_stop_string_as_vllm_and_sglang_name_it():
    # vLLM: choice["stop_reason"]; SGLang: choice["matched_stop"] (its protocol.py choice models).
    for field in ("stop_reason", "matched_stop"):
        choice = {"finish_reason": "stop", "message": {"content": "done"}, field: "END"}
        message, _ = to_message({"choices": [choice]}, "msg_1", "m", ["END"])
        assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END"), field
        tr = StreamTranslator("msg_1", "m", ["END"])
        chunks = [
            {"choices": [{"delta": {"content": "done"}}]},
            {"choices": [{"delta": {}, "finish_reason": "stop", field: "END"}]},
        ]
        out = [tr.start()] + [e for c in chunks for e in tr.feed(c)] + list(tr.finish())
        delta = json.loads(out[-2].split(b"data: ")[1])["delta"]
        assert (delta["stop_reason"], delta["stop_sequence"]) == ("stop_sequence", "END"), field


def test_a_tool_call_cut_by_the_output_limit_is_max_tokens():
    # Its arguments are unfinished: tool_use would have the client run a call it never got whole.
    call = {"id": "c1", "function": {"name": "Read", "arguments": '{"file_pa'}}
    choice = {"finish_reason": "length", "message": {"content": "", "tool_calls": [call]}}
    message, _ = to_message({"choices": [choice]}, "msg_1", "m", [])
    assert message["stop_reason"] == "max_tokens"


def test_a_document_goes_upstream_as_its_text_and_a_pdf_is_refused():
    """A PDF's base64 went upstream as prompt text: a huge prefill of nothing the model can read."""
    text = {"type": "text", "media_type": "text/plain", "data": "the notes"}
    pdf = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK" * 1000}

    def body(source: dict) -> dict:
        document = {"type": "document", "source": source, "title": "notes.txt"}
        content = [document, {"type": "text", "text": "summarise"}]
        return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": content}]}

    chat = to_chat_request(body(text), "m")
    assert chat["messages"][-1]["content"] == "notes.txt\nthe notes\nsummarise"
    with pytest.raises(APIError) as refused:
        to_chat_request(body(pdf), "m")
    assert refused.value.status == 400 and "plain text" in refused.value.message
