"""Each tool-call format against its model's real chat template (tests/data/chat_templates/).

One round trip per format: the conversation is rendered by the real template (jinja2, set up as
transformers sets it up) and by the gateway's Renderer; the tool list, the past call and the result
must appear in the gateway's prompt exactly as the template writes them. Then the model's own call
syntax is parsed from streamed text, split at every position (so mid-argument too), and the call
it yields is rendered back into the next prompt as the template would write it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ikcode.gateway.render import Renderer
from ikcode.gateway.schemas import MessagesRequest
from ikcode.gateway.tool_formats import (
    FORMATS,
    ToolCallEnd,
    ToolCallStart,
    callable_tools,
    detect_tool_format,
)
from ikcode.gateway.tool_formats.mistral import mistral_call_id
from ikcode.model.tokenizer import Tokenizer
from tests.tool_calls import collect

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
SYSTEM = "You are a coding agent."
READ_TOOL = {
    "name": "Read",
    "description": "Read a file from the local filesystem.",
    "input_schema": {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "The file to read"},
            "limit": {"type": "integer", "description": "Lines to read"},
        },
        "required": ["path"],
    },
}
CALL_ID = "toolu_01A09q90qw90lq917835lq9"
PAST_INPUT = {"path": "src/a.py", "limit": 10}
RESULT = "print('hello')"
NEW_INPUT = {"path": "src/b.py", "limit": 5}


def load_template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def render_template(template: str, messages: list[dict], tools: list[dict] | None, **extra: Any) -> str:
    """The template applied as transformers applies it (apply_chat_template's jinja environment)."""

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
    ):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # as the probe dates it
    return env.from_string(template).render(
        messages=messages, tools=tools, add_generation_prompt=True, **extra
    )


@dataclass
class Case:
    name: str  # the tool format
    template: str  # its model's template file
    model_output: str  # a call in the model's own syntax, as it generates it
    text_before: str = ""  # text the parser must pass through
    call_template: str = ""  # the template that renders calls and results, when not `template`
    call_id: str = CALL_ID  # the call id the template sees
    arguments_as_string: bool = False  # the template concatenates arguments as a string
    # vLLM's DeepSeek tool template has no whitespace control ({{ }} between indented lines): its
    # tool list is compared with whitespace left out.
    loose_tools_whitespace: bool = False
    template_extra: dict[str, Any] = field(default_factory=dict)
    specials: tuple[str, ...] = ()
    role_specials: tuple[str, ...] = ()


CASES = [
    Case(
        "hermes",
        "qwen3.jinja",
        "Let me read it.\n<tool_call>\n"
        '{"name": "Read", "arguments": {"path": "src/b.py", "limit": 5}}\n</tool_call>',
        text_before="Let me read it.\n",
        specials=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    ),
    Case(
        "qwen3_coder",
        "qwen3_coder.jinja",
        "Let me read it.\n<tool_call>\n<function=Read>\n<parameter=path>\nsrc/b.py\n</parameter>\n"
        "<parameter=limit>\n5\n</parameter>\n</function>\n</tool_call>",
        text_before="Let me read it.\n",
        specials=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    ),
    Case(
        "llama3_json",
        "llama3_1_json.jinja",
        '<|python_tag|>{"name": "Read", "parameters": {"path": "src/b.py", "limit": 5}}',
        template_extra={"tools_in_user_message": False, "bos_token": "<|begin_of_text|>"},
        specials=("<|python_tag|>",),
        role_specials=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    ),
    Case(
        "mistral",
        "mistral.jinja",
        '[TOOL_CALLS] [{"name": "Read", "arguments": {"path": "src/b.py", "limit": 5}}]',
        call_id=mistral_call_id(CALL_ID),
        template_extra={"bos_token": "<s>", "eos_token": "</s>"},
        specials=(
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
    ),
    Case(
        "deepseek_v3",
        "deepseek_v3_tools_vllm.jinja",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>Read\n```json\n"
        '{"path": "src/b.py", "limit": 5}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        call_template="deepseek_v3.jinja",
        arguments_as_string=True,
        loose_tools_whitespace=True,
        template_extra={"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
        specials=tuple(FORMATS["deepseek_v3"].markers),
    ),
    Case(
        "harmony",
        "gpt_oss.jinja",
        "<|channel|>analysis<|message|>The user wants b.py.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.Read <|constrain|>json<|message|>{"path": "src/b.py", "limit": 5}',
        specials=tuple(FORMATS["harmony"].markers),
    ),
]


def tokenizer_for(case: Case) -> Tokenizer:
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *case.specials, *case.role_specials)
    return Tokenizer.from_vocab(special_tokens=tuple(dict.fromkeys(specials)), chat_template=None)


def anthropic_request(past_input: dict, call_id: str = CALL_ID) -> dict:
    return {
        "model": "m",
        "max_tokens": 100,
        "system": SYSTEM,
        "tools": [READ_TOOL],
        "messages": [
            {"role": "user", "content": "Read src/a.py"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": call_id, "name": "Read", "input": past_input}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": RESULT}]},
        ],
    }


def openai_messages(case: Case, past_input: dict) -> list[dict]:
    arguments: Any = json.dumps(past_input) if case.arguments_as_string else past_input
    call = {"id": case.call_id, "type": "function", "function": {"name": "Read", "arguments": arguments}}
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Read src/a.py"},
        {"role": "assistant", "content": None if case.name == "deepseek_v3" else "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": case.call_id, "content": RESULT},
    ]


def ours(case: Case, request: dict) -> str:
    tokenizer = tokenizer_for(case)
    renderer = Renderer(tokenizer, tool_format=FORMATS[case.name]())
    body = MessagesRequest.model_validate(request)
    rendered = renderer.render(body.system, body.tools, body.tool_choice, body.messages)
    return tokenizer.decode(rendered.token_ids)


def pieces(case: Case, past_input: dict, call_id: str = CALL_ID) -> tuple[str, str, str]:
    """What the format writes for the tool list, the past call and its result."""
    fmt = FORMATS[case.name]()
    from ikcode.gateway.tool_formats import CallItem, ResultItem

    body = MessagesRequest.model_validate(anthropic_request(past_input, call_id))
    tools_text = fmt.tools_text(callable_tools(body.tools))
    call_text = fmt.assistant_text([("call", CallItem(call_id, "Read", past_input))])
    result = ResultItem(call_id, "Read", RESULT, False)
    turns = fmt.result_turns([result])
    result_text = (
        fmt.user_text([("result", result)])
        if turns is None
        else "".join(m.prefix + b + m.suffix for m, b in turns)
    )
    return tools_text, call_text, result_text


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_round_trip(case: Case) -> None:
    template = load_template(case.template)
    call_template = load_template(case.call_template) if case.call_template else template
    tools = callable_tools(MessagesRequest.model_validate(anthropic_request(PAST_INPUT)).tools)

    # 1. The format is the one the template shows.
    assert detect_tool_format(template) == case.name

    # 2. Definitions, the past call and its result, as the real template renders them.
    theirs_tools = render_template(template, openai_messages(case, PAST_INPUT), tools, **case.template_extra)
    theirs_calls = render_template(
        call_template, openai_messages(case, PAST_INPUT), tools, **case.template_extra
    )
    tools_text, call_text, result_text = pieces(case, PAST_INPUT)
    if case.loose_tools_whitespace:
        assert "".join(tools_text.split()) in "".join(theirs_tools.split())
    else:
        assert tools_text in theirs_tools
    assert call_text in theirs_calls
    assert result_text in theirs_calls
    prompt = ours(case, anthropic_request(PAST_INPUT))
    for piece in (tools_text, call_text, result_text):
        assert piece in prompt

    # 3. The model's call, streamed: the same call whatever the split, arguments before the end.
    output = case.model_output
    cut_mid_argument = output.index("b.py") + 2
    for split in range(len(output) + 1):
        parser = FORMATS[case.name]().new_parser(tools)
        first = parser.feed(output[:split])
        events = first + parser.feed(output[split:]) + parser.finish()
        text, calls = collect(events)
        assert text == case.text_before, split
        assert [(c.name, c.input) for c in calls] == [("Read", NEW_INPUT)], split
        if split == cut_mid_argument:  # inside "src/b.py": the call cannot have ended yet
            assert not any(isinstance(e, ToolCallEnd) for e in first)
    by_char = FORMATS[case.name]().new_parser(tools)
    events = [e for ch in output for e in by_char.feed(ch)] + by_char.finish()
    _, calls = collect(events)
    assert calls[0].num_deltas >= 3  # "{path", ", limit", "}": the arguments streamed in pieces
    started_at = next(i for i, e in enumerate(events) if isinstance(e, ToolCallStart))
    assert started_at < len(events) - 2

    # 4. The parsed call and its result, rendered back as the template renders them.
    new_id = calls[0].id
    back_case = Case(
        **{**case.__dict__, "call_id": mistral_call_id(new_id) if case.name == "mistral" else new_id}
    )
    theirs_back = render_template(
        call_template, openai_messages(back_case, calls[0].input), tools, **case.template_extra
    )
    _, call_back, result_back = pieces(case, calls[0].input, new_id)
    assert call_back in theirs_back and result_back in theirs_back
    prompt = ours(case, anthropic_request(calls[0].input, new_id))
    assert call_back in prompt and result_back in prompt


def two_calls_request() -> tuple[dict, list[dict]]:
    """Text and two calls in one turn, both results in the next: Anthropic shape, template shape."""
    request = anthropic_request(PAST_INPUT)
    request["messages"][1]["content"] = [
        {"type": "text", "text": "I will read both."},
        {"type": "tool_use", "id": "toolu_a", "name": "Read", "input": {"path": "a.py"}},
        {"type": "tool_use", "id": "toolu_b", "name": "Read", "input": {"path": "b.py", "limit": 3}},
    ]
    request["messages"][2]["content"] = [
        {"type": "tool_result", "tool_use_id": "toolu_a", "content": "A"},
        {"type": "tool_result", "tool_use_id": "toolu_b", "content": [{"type": "text", "text": "B"}]},
    ]
    calls = [{"path": "a.py"}, {"path": "b.py", "limit": 3}]
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Read src/a.py"},
        {
            "role": "assistant",
            "content": "I will read both.",
            "tool_calls": [{"type": "function", "function": {"name": "Read", "arguments": a}} for a in calls],
        },
        {"role": "tool", "content": "A"},
        {"role": "tool", "content": "B"},
    ]
    return request, messages


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.name)
def test_whole_prompt_matches_the_template_for_qwen3(case: Case) -> None:
    """For the ChatML families the gateway's prompt is the template's, byte for byte."""
    template = load_template(case.template)
    tools = callable_tools(MessagesRequest.model_validate(anthropic_request(PAST_INPUT)).tools)
    theirs = render_template(template, openai_messages(case, PAST_INPUT), tools)
    assert ours(case, anthropic_request(PAST_INPUT)) == theirs
    request, messages = two_calls_request()
    assert ours(case, request) == render_template(template, messages, tools)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("qwen3.jinja", "hermes"),
        ("qwen3_coder.jinja", "qwen3_coder"),
        ("llama3_1_json.jinja", "llama3_json"),
        ("llama3_1.jinja", "llama3_json"),  # no tool support in the template: the family's format
        ("mistral.jinja", "mistral"),
        ("deepseek_v3.jinja", "deepseek_v3"),
        ("gpt_oss.jinja", "harmony"),
        ("gemma3.jinja", "hermes"),  # no tool format of its own
    ],
)
def test_detection_from_real_templates(template: str, expected: str) -> None:
    assert detect_tool_format(load_template(template)) == expected


def test_profile_names_every_format_and_an_unknown_one_is_refused() -> None:
    from typing import get_args

    from ikcode.gateway.tool_formats import UnknownToolFormat, tool_format_for
    from ikcode.profiles import ModelSection

    allowed = get_args(ModelSection.model_fields["tool_format"].annotation)
    assert set(allowed) == {""} | set(FORMATS)
    assert tool_format_for(load_template("qwen3.jinja"), "harmony").name == "harmony"  # the override wins
    with pytest.raises(UnknownToolFormat, match="unknown tool_format 'xml'"):
        tool_format_for(None, "xml")


DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@pytest.mark.parametrize(
    ("template", "bos", "eos", "user", "assistant", "assistant_end"),
    [
        # DeepSeek ends only assistant turns; its bos/eos come from the tokenizer's ids.
        ("deepseek_v3.jinja", DS_BOS, DS_EOS, "<｜User｜>", "<｜Assistant｜>", DS_EOS),
        # gpt-oss's template calls strftime_now, as transformers lets templates do.
        ("gpt_oss.jinja", "<|startoftext|>", "<|return|>", "<|start|>user<|message|>", "<|start|>assistant",
         "<|end|>"),
    ],
)  # fmt: skip
def test_role_markers_probed_from_real_templates(template, bos, eos, user, assistant, assistant_end) -> None:
    from ikcode.gateway.chat_format import derive_chat_format

    specials = ("<|endoftext|>", bos, eos, *FORMATS[detect_tool_format(load_template(template))].markers)
    tokenizer = Tokenizer.from_vocab(special_tokens=tuple(dict.fromkeys(specials)), eos_tokens=(eos,))
    tokenizer.bos_token_id = tokenizer.token_to_id(bos)
    found = derive_chat_format(tokenizer, load_template(template))
    assert found.name == "probed"
    assert (found.prefix["user"], found.generation_prompt, found.suffix["assistant"]) == (
        user,
        assistant,
        assistant_end,
    )


def test_whole_prompt_matches_the_template_for_llama3_json() -> None:
    """Role markers probed from the template, the format detected from it: byte for byte."""
    case = next(c for c in CASES if c.name == "llama3_json")
    template = load_template(case.template)
    bos = case.template_extra["bos_token"]
    specials = ("<|endoftext|>", *case.specials, *case.role_specials)
    tokenizer = Tokenizer.from_vocab(
        special_tokens=specials, eos_tokens=("<|eot_id|>",), chat_template=template
    )
    tokenizer.bos_token_id = tokenizer.token_to_id(bos)
    renderer = Renderer(tokenizer)
    assert (renderer.format.name, renderer.tool_format.name) == ("probed", "llama3_json")
    body = MessagesRequest.model_validate(anthropic_request(PAST_INPUT))
    ids = renderer.render(body.system, body.tools, body.tool_choice, body.messages).token_ids
    tools = callable_tools(body.tools)
    assert tokenizer.decode(ids) == render_template(
        template, openai_messages(case, PAST_INPUT), tools, **case.template_extra
    )
