"""Where qwen3_coder and harmony once parted from their references: vLLM's parsers (read through
the cited lines) and the models' own templates (tests/data/chat_templates, rendered by jinja2 as
transformers renders them). Parsing is checked at every split of the reply, as it streams."""

from __future__ import annotations

import json

import pytest

from ikcode.gateway.tool_formats import FORMATS
from tests.test_tool_formats import (
    CASES,
    NEW_INPUT,
    PAST_INPUT,
    anthropic_request,
    load_template,
    render_template,
    tokenizer_for,
)
from tests.tool_calls import collect

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": "",
            "parameters": {"type": "object", "properties": {key: {"type": kind}}},
        },
    }
    for name, key, kind in (
        ("Read", "path", "string"),
        ("Bash", "command", "string"),
        ("Sleep", "s", "number"),
    )
]


def parse(fmt: str, chunks: list[str], tools: list[dict] = TOOLS) -> tuple[str, list[tuple[str, dict]]]:
    parser = FORMATS[fmt]().new_parser(tools)
    events = [event for chunk in chunks for event in parser.feed(chunk)] + parser.finish()
    text, calls = collect(events)
    return text, [(call.name, call.input) for call in calls]


def parse_every_split(fmt: str, reply: str, tools: list[dict] = TOOLS) -> tuple[str, list]:
    whole = parse(fmt, [reply], tools)
    for at in range(len(reply) + 1):
        assert parse(fmt, [reply[:at], reply[at:]], tools) == whole, reply[:at]
    return whole


def test_qwen3_coder_two_functions_in_one_tool_call_are_two_calls():
    # vLLM qwen3coder_tool_parser.py: tool_call_function_regex (:54-55), every <function=...> of a
    # <tool_call> its own call (_get_function_calls). They were merged into one Read with a command.
    reply = (
        "<tool_call>\n<function=Read>\n<parameter=path>\na\n</parameter>\n</function>\n"
        "<function=Bash>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>"
    )
    assert parse_every_split("qwen3_coder", reply) == (
        "",
        [("Read", {"path": "a"}), ("Bash", {"command": "ls"})],
    )


@pytest.mark.parametrize("raw", ["ls [a-z]*", 'echo {"k": 1} > f.json', "false"])
def test_qwen3_coder_keeps_a_union_typed_string_as_written(raw):
    # vLLM's _convert_param_value: json only for objects and arrays, then ast.literal_eval, else the
    # string as it is. json_repair turned `ls [a-z]*` into ['a-z'].
    spec = {"type": "object", "properties": {"command": {"type": ["string", "null"]}}}
    tools = [{"type": "function", "function": {"name": "Bash", "parameters": spec}}]
    reply = (
        f"<tool_call>\n<function=Bash>\n<parameter=command>\n{raw}\n</parameter>\n</function>\n</tool_call>"
    )
    assert parse("qwen3_coder", [reply], tools) == ("", [("Bash", {"command": raw})])


def test_qwen3_coder_nan_for_a_number_stays_text_so_the_arguments_are_json():
    parser = FORMATS["qwen3_coder"]().new_parser(TOOLS)
    reply = "<tool_call>\n<function=Sleep>\n<parameter=s>\nnan\n</parameter>\n</function>\n</tool_call>"
    events = parser.feed(reply) + parser.finish()
    partial = "".join(getattr(event, "partial_json", "") for event in events)

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    assert json.loads(partial, parse_constant=refuse) == {"s": "nan"}


def test_harmony_reply_cut_in_a_message_header_shows_no_markup():
    reply = "<|channel|>analysis<|message|>Need a file.<|end|><|start|>assistant<|channel|>comm"
    text, calls = parse("harmony", [reply])
    assert "<|" not in text and calls == []


def _function(name: str, properties: dict, required: tuple[str, ...] = ()) -> dict:
    parameters = {"type": "object", "properties": properties, "required": list(required)}
    return {"type": "function", "function": {"name": name, "description": "D.", "parameters": parameters}}


HARMONY_TOOLS = {
    "two tools": [
        _function("A", {"x": {"type": "string", "description": "X"}}, ("x",)),
        _function("B", {"y": {"type": "integer", "description": "Y"}}),
    ],
    "no properties": [_function("A", {}), _function("B", {"y": {"type": "integer", "description": "Y"}})],
    "parameter without description": [_function("A", {"x": {"type": "string"}}, ("x",))],
    "enum default": [
        _function("A", {"m": {"type": "string", "enum": ["a", "b"], "default": "a", "description": "M"}})
    ],
    "nested object": [
        _function(
            "A",
            {
                "o": {
                    "type": "object",
                    "description": "O",
                    "properties": {"k": {"type": "string"}, "n": {"type": "number"}},
                    "required": ["k"],
                }
            },
        )
    ],
}


@pytest.mark.parametrize("case", list(HARMONY_TOOLS))
def test_harmony_tool_list_is_the_templates(case):
    # gpt_oss.jinja: a blank line between tools (:142), `() => any;` without properties (:144), no
    # comment line for a parameter without description (:118-119), an enum default raw (:129).
    tools = HARMONY_TOOLS[case]
    theirs = render_template(load_template("gpt_oss.jinja"), [{"role": "user", "content": "hi"}], tools)
    assert FORMATS["harmony"]().tools_text(tools) in theirs


def test_qwen3_coder_union_type_is_written_as_the_template_writes_it():
    # qwen3_coder.jinja:51 writes `param_fields.type | string`: a list as Python shows it.
    spec = {"type": "object", "properties": {"pattern": {"type": ["string", "null"], "description": "Regex"}}}
    tools = [{"type": "function", "function": {"name": "Grep", "description": "Search.", "parameters": spec}}]
    theirs = render_template(load_template("qwen3_coder.jinja"), [{"role": "user", "content": "hi"}], tools)
    assert FORMATS["qwen3_coder"]().tools_text(tools) in theirs


def _refuse(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def test_arguments_strict_json_has_no_word_for_go_to_the_client_as_text():
    """json.loads takes NaN and a lone surrogate escape, and a literal_eval gives bytes or complex
    numbers: sent as they were, the client's input_json_delta did not parse and a whole answer
    was a 500."""
    hermes = '<tool_call>\n{"name": "Read", "arguments": {"path": NaN, "s": "a\\ud83d"}}\n</tool_call>'
    text, calls = parse_every_split("hermes", hermes)
    assert calls == [("Read", {"path": "NaN", "s": "a?"})]
    spec = {"type": "object", "properties": {"v": {"type": ["string", "null"]}}}
    tools = [{"type": "function", "function": {"name": "Bash", "parameters": spec}}]
    for raw, shown in (("1j", "1j"), ("b'x'", "b'x'"), ("...", "Ellipsis"), ("inf", "inf")):
        reply = f"<tool_call>\n<function=Bash>\n<parameter=v>\n{raw}\n</parameter>\n</function>\n</tool_call>"
        parser = FORMATS["qwen3_coder"]().new_parser(tools)
        events = parser.feed(reply) + parser.finish()
        partial = "".join(getattr(event, "partial_json", "") for event in events)
        assert json.loads(partial, parse_constant=_refuse) == {"v": shown}, raw


def test_a_close_marker_inside_a_json_string_is_the_strings_text():
    """A Write of a file that mentions `</tool_call>` (code about tool calls): the call ended
    there, its content was dropped and the rest became text."""
    content = 'print("</tool_call>")'
    reply = "<tool_call>\n" + json.dumps({"name": "Read", "arguments": {"path": content}}) + "\n</tool_call>"
    assert parse_every_split("hermes", reply) == ("", [("Read", {"path": content})])


def test_a_close_marker_inside_a_qwen3_coder_parameter_is_the_values_text():
    """The same for qwen3_coder's XML calls: the value was cut at the marker, the call still ran
    (a Write of a truncated file) and the rest of it came out as text."""
    content = 'line "1"\n{x} </tool_call> and more'
    reply = (
        f"<tool_call>\n<function=Read>\n<parameter=path>\n{content}\n</parameter>\n</function>\n</tool_call>"
    )
    assert parse_every_split("qwen3_coder", reply) == ("", [("Read", {"path": content})])


@pytest.mark.parametrize("items", [True, [{"type": "string"}]], ids=["items true", "items a list"])
def test_harmony_lists_a_tool_whose_array_items_are_not_an_object(items):
    spec = {"type": "object", "properties": {"xs": {"type": "array", "items": items}}}
    tools = [{"type": "function", "function": {"name": "T", "description": "", "parameters": spec}}]
    assert "xs?: any[]" in FORMATS["harmony"]().tools_text(tools)


def test_gpt_oss_generation_goes_on_past_its_reasoning():
    """gpt-oss ends its analysis message with <|end|> before the answer or the call: <|end|> as a
    stop token ended every reply after the hidden reasoning (content [], end_turn)."""
    from ikcode.gateway.chat_format import derive_chat_format
    from ikcode.gateway.render import Renderer
    from ikcode.gateway.reply_builder import ReplyBuilder
    from ikcode.model.tokenizer import Tokenizer
    from tests.test_tool_formats import CASES

    case = next(c for c in CASES if c.name == "harmony")
    specials = ("<|startoftext|>", "<|endoftext|>", *case.specials)
    tokenizer = Tokenizer.from_vocab(special_tokens=specials, eos_tokens=None)  # as a GGUF's specials
    stop = {tokenizer.decode([i]) for i in tokenizer.eos_token_ids}
    assert stop == {"<|return|>", "<|call|>", "<|endoftext|>"}  # not <|end|>
    template = load_template("gpt_oss.jinja")
    tokenizer.chat_template = template
    renderer = Renderer(tokenizer, derive_chat_format(tokenizer, template), tool_format=FORMATS["harmony"]())
    assert "<|end|>" not in {tokenizer.decode([i]) for i in renderer.stop_token_ids}
    assert {"<|return|>", "<|call|>"} <= {tokenizer.decode([i]) for i in renderer.stop_token_ids}
    reply = (
        "<|channel|>analysis<|message|>The user says hi.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello!"
    )
    builder = ReplyBuilder(tokenizer, renderer.stop_token_ids, [], FORMATS["harmony"]().new_parser([]))
    for token in tokenizer.encode(reply):  # what the engine streams until it stops
        assert token not in renderer.stop_token_ids
        builder.push([token])
    builder.finish()
    assert builder.content == [{"type": "text", "text": "Hello!"}]


def test_llama3_json_an_object_without_arguments_is_text():
    """A reply that starts with a JSON object holding a "name" (a package.json shown to the user)
    became tool_use("my-app", {}) and a "no such tool" round trip; vLLM's parser needs the
    arguments member (llama_tool_parser.py:95-97) and gives the text."""
    reply = '{"name": "my-app", "version": "1.0.0"}\n\nThis is your package.json.'
    assert parse_every_split("llama3_json", reply) == (reply, [])
    call = '{"name": "Read", "parameters": {"path": "a"}}'
    assert parse_every_split("llama3_json", call) == ("", [("Read", {"path": "a"})])


def test_qwen3_coder_a_string_parameter_keeps_the_text_null():
    """vLLM reads "null" as null before looking at the type: an Edit whose new text is `null`
    reached Claude Code with new_string None and failed the tool's validation."""
    reply = "<tool_call>\n<function=Read>\n<parameter=path>\nnull\n</parameter>\n</function>\n</tool_call>"
    assert parse("qwen3_coder", [reply]) == ("", [("Read", {"path": "null"})])
    sleep = "<tool_call>\n<function=Sleep>\n<parameter=s>\nnull\n</parameter>\n</function>\n</tool_call>"
    assert parse("qwen3_coder", [sleep]) == ("", [("Sleep", {"s": None})])  # a number's null stays null


def test_a_qwen3_coder_value_that_mentions_its_end_tag_is_kept_whole():
    """A Write of a file that mentions </parameter> (an XML tool format's own code): the value
    ended at the first one, the call ran with a truncated file and the rest became text. Only a
    </parameter> that the next parameter or the call's end follows closes the value."""
    content = 'END = "</parameter>"\nif tail.endswith("</parameter>"):\n    pass'
    reply = (
        "<tool_call>\n<function=Read>\n<parameter=path>\n"
        + content
        + "\n</parameter>\n</function>\n</tool_call>"
    )
    assert parse_every_split("qwen3_coder", reply) == ("", [("Read", {"path": content})])
    no_function_close = (
        "<tool_call>\n<function=Read>\n<parameter=path>\n" + content + "\n</parameter>\n</tool_call>"
    )
    assert parse_every_split("qwen3_coder", no_function_close) == ("", [("Read", {"path": content})])
    two = (
        "<tool_call>\n<function=Bash>\n<parameter=command>\necho '</parameter> x'\n</parameter>\n"
        "<parameter=path>\n/a\n</parameter>\n</function>\n</tool_call>"
    )
    assert parse_every_split("qwen3_coder", two) == (
        "",
        [("Bash", {"command": "echo '</parameter> x'", "path": "/a"})],
    )


def test_mistral_text_after_the_calls_array_is_the_replys_text():
    """Everything after the array's "]" was dropped: the model's words after its calls were lost."""
    call = '[TOOL_CALLS] [{"name": "Read", "arguments": {"path": "/a"}}]'
    assert parse_every_split("mistral", call + " Reading it now, then the tests.") == (
        "Reading it now, then the tests.",
        [("Read", {"path": "/a"})],
    )
    assert parse_every_split("mistral", call + "\n") == ("", [("Read", {"path": "/a"})])
    assert parse("mistral", ["[TOOL_CALLS] [] so ", "no call"]) == ("[TOOL_CALLS] [] so no call", [])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_stop_sequence_inside_a_calls_arguments_is_the_calls_text_in_every_format(case):
    """Each format's parser says when it is inside a named call: a stop sequence there is part of
    the arguments (the reply builder matched stop sequences on the raw output, and a path or a
    command holding one cut the call there)."""
    from ikcode.gateway.reply_builder import ReplyBuilder
    from ikcode.gateway.schemas import MessagesRequest
    from ikcode.gateway.tool_formats import callable_tools

    tools = callable_tools(MessagesRequest.model_validate(anthropic_request(PAST_INPUT)).tools)
    tokenizer = tokenizer_for(case)
    builder = ReplyBuilder(tokenizer, (), ["##"], parser=FORMATS[case.name]().new_parser(tools))
    for token in tokenizer.encode(case.model_output.replace("src/b.py", "src/##.py")):
        builder.push([token])
    builder.finish()
    assert builder.stop_sequence is None and not builder.done
    (call,) = [block for block in builder.content if block["type"] == "tool_use"]
    assert call["input"] == {**NEW_INPUT, "path": "src/##.py"}


def test_mistral_more_calls_or_text_after_the_first_ones_are_each_what_they_are():
    """After a calls array, a second [TOOL_CALLS] array came out as its raw text; after a v11
    `name{...}` call, text was dropped, and text holding a "{" became a call named by its words."""
    first = '[TOOL_CALLS] [{"name": "Read", "arguments": {"path": "/a"}}]'
    second = '\n[TOOL_CALLS] [{"name": "Bash", "arguments": {"command": "ls"}}]'
    assert parse_every_split("mistral", first + second) == (
        "",
        [("Read", {"path": "/a"}), ("Bash", {"command": "ls"})],
    )
    named = '[TOOL_CALLS]Read{"path": "/a"}'
    assert parse_every_split("mistral", named + " Done.") == ("Done.", [("Read", {"path": "/a"})])
    assert parse_every_split("mistral", named + " Then {x}") == ("Then {x}", [("Read", {"path": "/a"})])
    assert parse_every_split("mistral", named + '[TOOL_CALLS]Bash{"command": "ls"}') == (
        "",
        [("Read", {"path": "/a"}), ("Bash", {"command": "ls"})],
    )


def test_a_stop_sequence_in_hidden_reasoning_does_not_end_the_reply():
    """gpt-oss writes its reasoning in the analysis channel, which the client never sees: matched
    on the raw output, a stop sequence there ended the reply before its answer (no content)."""
    from ikcode.gateway.reply_builder import ReplyBuilder

    case = next(c for c in CASES if c.name == "harmony")
    tokenizer = tokenizer_for(case)
    reply = (
        "<|channel|>analysis<|message|>User wants ## headings.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Here ## you go"
    )
    builder = ReplyBuilder(tokenizer, (), ["##"], parser=FORMATS["harmony"]().new_parser([]))
    for token in tokenizer.encode(reply):
        builder.push([token])
    builder.finish()
    assert builder.content == [{"type": "text", "text": "Here "}] and builder.stop_sequence == "##"


def test_mistral_with_no_call_made_reads_the_same_however_the_text_is_split():
    """Text after an empty calls array was dropped feed by feed: a [TOOL_CALLS] arriving in a
    later feed restarted parsing (a call), in the same feed it did not (all text)."""
    reply = '[TOOL_CALLS] [] Let me read it.[TOOL_CALLS]Read{"path": "/a"}'
    assert parse_every_split("mistral", reply) == (reply, [])
