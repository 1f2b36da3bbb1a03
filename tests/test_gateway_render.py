"""Rendering: ChatML markers, tools, stripped billing line, append-only turns, incremental tokenization."""

from __future__ import annotations

import pytest

from ikcode.gateway.chat_format import chatml_format, probe_template
from ikcode.gateway.errors import APIError
from ikcode.gateway.render import Renderer
from ikcode.gateway.schemas import MessagesRequest
from ikcode.model.tokenizer import Tokenizer

BILLING = "x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=sdk-cli;"
TOOLS = [
    {
        "name": "Read",
        "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {}}},
    },
    {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object"}},
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_vocab(merges=[("h", "e"), ("Ġ", "he"), ("l", "l"), ("o", "n")])


def render(renderer: Renderer, body: dict):
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 10, **body})
    return renderer.render(request.system, request.tools, request.tool_choice, request.messages)


def text_of(tokenizer: Tokenizer, rendered) -> str:
    return tokenizer.decode(rendered.token_ids)


def test_chatml_rendering_with_tools_and_stripped_billing_line(tokenizer):
    renderer = Renderer(tokenizer)
    rendered = render(
        renderer,
        {
            "system": [
                {"type": "text", "text": BILLING},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            ],
            "tools": TOOLS,
            "messages": [{"role": "user", "content": "hello"}],
        },
    )
    text = text_of(tokenizer, rendered)
    assert "x-anthropic-billing-header" not in text
    assert text.startswith("<|im_start|>system\nYou are Claude Code.\n\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "Read"' in text
    assert text.endswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    # Two conversations that differ only in the billing line share every token.
    other = render(
        renderer,
        {
            "system": [
                {"type": "text", "text": BILLING.replace("a1b", "ff0")},
                {"type": "text", "text": "You are Claude Code."},
            ],
            "tools": TOOLS,
            "messages": [{"role": "user", "content": "hello"}],
        },
    )
    assert other.token_ids == rendered.token_ids


def test_mid_conversation_system_message_stays_in_place(tokenizer):
    rendered = render(
        Renderer(tokenizer),
        {
            "system": "top",
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "system", "content": "note"},
                {"role": "user", "content": [{"type": "text", "text": "c"}]},
            ],
        },
    )
    text = text_of(tokenizer, rendered)
    assert text.index("<|im_start|>system\nnote<|im_end|>") > text.index("<|im_start|>assistant\nb<|im_end|>")
    assert text.index("<|im_start|>system\nnote<|im_end|>") < text.index("<|im_start|>user\nc<|im_end|>")


def test_tool_round_trip_and_thinking_rendered(tokenizer):
    rendered = render(
        Renderer(tokenizer),
        {
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": "read it"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                        {"type": "text", "text": "Reading."},
                        {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.py"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": "x = 1",
                            "is_error": False,
                        }
                    ],
                },
            ],
        },
    )
    text = text_of(tokenizer, rendered)
    assert (
        '<think>\nhmm\n</think>\nReading.\n<tool_call>\n{"name": "Read", "arguments": {"path": "a.py"}}'
        "\n</tool_call>" in text
    )
    assert "<|im_start|>user\n<tool_response>\nx = 1\n</tool_response><|im_end|>" in text


def test_special_tokens_in_content_stay_text(tokenizer):
    rendered = render(Renderer(tokenizer), {"messages": [{"role": "user", "content": "<|im_end|>"}]})
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert rendered.token_ids.count(im_end) == 1  # only the real end of the user turn


def test_images_refused_documents_flattened(tokenizer):
    renderer = Renderer(tokenizer)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(APIError) as caught:
        render(renderer, {"messages": [{"role": "user", "content": [image]}]})
    assert caught.value.status == 400 and "image" in caught.value.message
    # In a tool result (Read on a picture) a placeholder keeps the session usable.
    result = {"type": "tool_result", "tool_use_id": "t", "content": [image]}
    assert "image omitted" in text_of(
        tokenizer, render(renderer, {"messages": [{"role": "user", "content": [result]}]})
    )
    document = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "doc body"},
    }
    assert "doc body" in text_of(
        tokenizer, render(renderer, {"messages": [{"role": "user", "content": [document]}]})
    )
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AAAA"}}
    with pytest.raises(APIError):
        render(renderer, {"messages": [{"role": "user", "content": [pdf]}]})


def test_append_only_with_generated_reply_ids_and_incremental_tokenization(tokenizer):
    renderer = Renderer(tokenizer)
    first_messages = [{"role": "user", "content": "hello there"}]
    first = render(renderer, {"system": "sys", "tools": TOOLS, "messages": first_messages})
    # The model "generated" ids whose text re-tokenizes differently (single bytes, no merges).
    generated = (
        [tokenizer.token_to_id(c) for c in "he"]
        + tokenizer.encode("llo")
        + [tokenizer.token_to_id("<|im_end|>")]
    )
    assert tokenizer.encode("hello") != generated[:-1]
    content = [{"type": "text", "text": "hello"}]
    renderer.remember_reply(first, content, generated)
    second_messages = first_messages + [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}],
        },
        {"role": "user", "content": "more"},
    ]
    second = render(renderer, {"system": "sys", "tools": TOOLS, "messages": second_messages})
    expected_prefix = first.token_ids + generated  # prompt + reply (ending in <|im_end|>)
    assert second.token_ids[: len(expected_prefix)] == expected_prefix
    assert second.fresh_tokens == len(tokenizer.encode("more"))  # only the new tail was tokenized
    # Without the remembered reply the assistant turn is rendered from text: still well formed.
    cold = render(Renderer(tokenizer), {"system": "sys", "tools": TOOLS, "messages": second_messages})
    assert cold.token_ids[: len(first.token_ids)] == first.token_ids
    assert cold.token_ids != second.token_ids


def test_segment_concatenation_matches_whole_string_tokenization(tokenizer):
    """Segments start and end at special tokens, so BPE never merges across them."""
    renderer = Renderer(tokenizer, chat_format=chatml_format())
    rendered = render(renderer, {"system": "he said", "messages": [{"role": "user", "content": "hello he"}]})
    whole = tokenizer.encode(tokenizer.decode(rendered.token_ids), allow_special=True)
    assert whole == rendered.token_ids


def test_generic_template_probed():
    llama3 = (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    fmt = probe_template(llama3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    assert fmt is not None
    assert fmt.start == "<|begin_of_text|>"
    assert fmt.prefix["user"] == "<|start_header_id|>user<|end_header_id|>\n\n"
    assert fmt.suffix["assistant"] == "<|eot_id|>"
    assert fmt.generation_prompt == "<|start_header_id|>assistant<|end_header_id|>\n\n"


@pytest.mark.parametrize("salt", ["", "alice"])
def test_incremental_block_hashes_equal_full_hashing(tokenizer, salt):
    from ikcode.cache import hash_blocks
    from ikcode.gateway.block_hashes import IncrementalBlockHasher

    renderer, hasher = Renderer(tokenizer), IncrementalBlockHasher(block_size=4)
    messages = [{"role": "user", "content": "hello there, the first question"}]
    first = render(renderer, {"system": "sys", "messages": messages})
    assert hasher.hashes(first, salt) == hash_blocks(first.token_ids, 4, salt)
    messages += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and then?"}]
    second = render(renderer, {"system": "sys", "messages": messages})
    assert hasher.hashes(second, salt) == hash_blocks(second.token_ids, 4, salt)
    assert hasher.resumed_blocks == first.boundaries[-1][1] // 4  # up to the end of the last message


def test_block_hashes_resume_only_where_the_tokens_are_the_same(tokenizer):
    """An assistant turn renders as the generated ids while the store remembers them, else from
    its text (other ids, here another length): the chain digest must tell the two apart, or the
    hasher would resume with the other rendering's block hashes (and the cache serve its KV)."""
    from ikcode.cache import hash_blocks
    from ikcode.gateway.block_hashes import IncrementalBlockHasher

    hasher = IncrementalBlockHasher(block_size=4)
    first_messages = [{"role": "user", "content": "hello there"}]
    remembering = Renderer(tokenizer)
    first = render(remembering, {"system": "sys", "messages": first_messages})
    generated = [tokenizer.token_to_id(c) for c in "hello"] + [tokenizer.token_to_id("<|im_end|>")]
    remembering.remember_reply(first, [{"type": "text", "text": "hello"}], generated)
    messages = first_messages + [
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and then, what happened next?"},
    ]
    with_reply = render(remembering, {"system": "sys", "messages": messages})
    from_text = render(Renderer(tokenizer), {"system": "sys", "messages": messages})  # reply not known
    assert with_reply.token_ids != from_text.token_ids
    assert hasher.hashes(with_reply) == hash_blocks(with_reply.token_ids, 4)
    assert hasher.hashes(from_text) == hash_blocks(from_text.token_ids, 4)


def test_a_plain_system_prompt_cannot_spell_another_prompts_segment_key():
    """The segment store is shared by every user: a system prompt without tools that spelt the
    key of one with tools ("system\\0" + prefix + "\\0" + text) got its tokens from whichever
    request came first (llama3_json, whose tools change the system segment's header)."""
    from ikcode.gateway.render import callable_tools
    from tests.test_tool_formats import CASES, load_template

    case = next(case for case in CASES if case.name == "llama3_json")
    specials = ("<|endoftext|>", *case.specials, *case.role_specials)
    tokenizer = Tokenizer.from_vocab(
        special_tokens=specials, eos_tokens=("<|eot_id|>",), chat_template=load_template(case.template)
    )
    tokenizer.bos_token_id = tokenizer.token_to_id("<|begin_of_text|>")
    tools = [{"name": "Read", "description": "Read a file", "input_schema": {"type": "object"}}]
    hi = [{"role": "user", "content": "hi"}]

    def request(system: str | None, with_tools: bool) -> MessagesRequest:
        body = {"model": "m", "max_tokens": 5, "messages": hi} | ({"system": system} if system else {})
        return MessagesRequest.model_validate(body | ({"tools": tools} if with_tools else {}))

    def render(renderer: Renderer, system: str, with_tools: bool) -> list[int]:
        r = request(system, with_tools)
        return renderer.render(r.system, r.tools, r.tool_choice, r.messages).token_ids

    probe = Renderer(tokenizer)
    prefix = probe.tool_format.system_prefix(probe.format.prefix["system"])
    assert prefix != probe.format.prefix["system"]  # the case where the keys could meet
    listed = probe.tool_format.tools_text(callable_tools(request(None, True).tools))
    text = probe.tool_format.system_text("You are a helpful agent.", listed)
    alone = render(Renderer(tokenizer), "You are a helpful agent.", True)
    shared = Renderer(tokenizer)
    render(shared, prefix + "\x00" + text, False)  # another user's request first
    assert render(shared, "You are a helpful agent.", True) == alone


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        (None, "has no chat template"),
        ("{{ raise_exception('only user and assistant roles are supported') }}", "only user and assistant"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "no end-of-turn token"),
    ],
)
def test_chatml_fallback_is_a_warning_that_says_why(caplog, template, reason):
    """A model whose vocabulary has no ChatML markers and whose template cannot be read is
    prompted in ChatML: the server says so, and why, instead of serving poor answers silently."""
    from ikcode.gateway.chat_format import derive_chat_format

    plain = Tokenizer.from_vocab(special_tokens=("<|endoftext|>", "</s>"), eos_tokens=("</s>",))
    with caplog.at_level("WARNING", logger="ikcode.gateway"):
        found = derive_chat_format(plain, template)
    assert found.name == "chatml"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "ChatML" in warned[0] and reason in warned[0]


def test_no_warning_for_a_chatml_vocabulary(caplog, tokenizer):
    from ikcode.gateway.chat_format import derive_chat_format

    with caplog.at_level("WARNING", logger="ikcode.gateway"):
        assert derive_chat_format(tokenizer, None).name == "chatml"
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize(
    ("first", "second", "format_name"),
    [
        # A tool call's input in another key order: the formats write it as given.
        (
            [{"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "a", "limit": 2}}],
            [{"type": "tool_use", "id": "t1", "name": "Read", "input": {"limit": 2, "path": "a"}}],
            None,
        ),
        # An empty text block is a joining newline in the rendering.
        (
            [{"type": "text", "text": "x"}],
            [{"type": "text", "text": ""}, {"type": "text", "text": "x"}],
            None,
        ),
        # harmony: a string and a text block are one turn, both framed as the final channel.
        ("hello", [{"type": "text", "text": "hello"}], "harmony"),
    ],
)
def test_a_turn_is_rendered_as_itself_whatever_was_rendered_before(first, second, format_name):
    """The store of tokenized turns is shared by every user and conversation: a turn must take
    the tokens of its own rendering, never those of another turn that merely looks alike."""
    from ikcode.gateway.tool_formats import FORMATS

    def renderer() -> Renderer:
        fmt = FORMATS[format_name]() if format_name else None
        specials = tuple(FORMATS[format_name].markers) if format_name else ()
        tok = Tokenizer.from_vocab(special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", *specials))
        return Renderer(tok, tool_format=fmt)

    def body(assistant) -> dict:
        return {"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": assistant},
            {"role": "user", "content": "go on"},
        ]}  # fmt: skip

    shared = renderer()
    render(shared, body(first))
    after_first = render(shared, body(second)).token_ids
    assert after_first == render(renderer(), body(second)).token_ids
    if format_name == "harmony":  # and the string form is framed, as the block form is
        assert after_first == render(renderer(), body(first)).token_ids
