"""Output parsing (Hermes format): tool calls as they stream, sloppy JSON repaired, malformed
calls as text, stop sequences. Every format's round trip is in test_tool_formats.py."""

from __future__ import annotations

import json

import pytest

from ikcode.gateway.reply_builder import ReplyBuilder
from ikcode.gateway.tool_formats import HermesFormat, TextPiece, ToolArgsDelta, ToolCallEnd, ToolCallStart
from ikcode.model.tokenizer import Tokenizer
from tests.tool_calls import Call, collect

CALL = '<tool_call>\n{"name": "Read", "arguments": {"path": "a.py"}}\n</tool_call>'


def feed_chars(text: str) -> list:
    parser = HermesFormat().new_parser([])
    out = []
    for ch in text:  # the worst case: one character per delta
        out += parser.feed(ch)
    return out + parser.finish()


def texts(items) -> str:
    return "".join(i.text for i in items if isinstance(i, TextPiece))


def calls(items) -> list[Call]:
    return collect(items)[1]


def test_tool_call_split_across_deltas():
    items = feed_chars("Let me look." + CALL)
    found = calls(items)
    assert texts(items) == "Let me look."
    assert len(found) == 1 and found[0].name == "Read" and found[0].input == {"path": "a.py"}
    assert found[0].id.startswith("toolu_") and len(found[0].id) > 20


def test_several_calls_and_text_after():
    items = feed_chars(CALL + "\n" + CALL.replace("a.py", "b.py") + " done")
    assert [c.input["path"] for c in calls(items)] == ["a.py", "b.py"]
    assert texts(items) == "\n done"


def test_arguments_stream_member_by_member_before_the_call_closes():
    parser = HermesFormat().new_parser([])
    head = '<tool_call>\n{"name": "Edit", "arguments": {"path": "a.py", "old": "x'
    events = parser.feed(head)
    assert [type(e) for e in events] == [ToolCallStart, ToolArgsDelta]  # "path" is complete
    assert events[1].partial_json == '{"path": "a.py"'
    events = parser.feed('", "new": "y"}}\n</tool_call>')
    pieces = [e.partial_json for e in events if isinstance(e, ToolArgsDelta)]
    assert pieces == [', "old": "x"', ', "new": "y"', "}"]
    assert isinstance(events[-1], ToolCallEnd) and events[-1].input == {
        "path": "a.py",
        "old": "x",
        "new": "y",
    }


@pytest.mark.parametrize(
    "raw",
    [
        "<tool_call>{'name': 'Read', 'arguments': {'path': 'a.py',}}</tool_call>",  # Python-style quotes
        '<tool_call>{"name": "Read", "arguments": {path: "a.py"}}</tool_call>',  # an unquoted key
        '<tool_call>{"name": "Read", "arguments": {"path": "a.py", "all": True}}</tool_call>',
    ],
)
def test_sloppy_json_is_repaired(raw):
    found = calls(feed_chars(raw))
    assert len(found) == 1 and found[0].input["path"] == "a.py"
    assert json.loads(found[0].json) == found[0].input  # the streamed pieces are valid JSON


@pytest.mark.parametrize(
    "raw",
    [
        '<tool_call>{"name": "Read", "arguments": {"path": </tool_call>',
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "Read", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "Read", "arguments": {"path": "a.py"',  # cut by max_tokens
    ],
)
def test_malformed_calls_become_text(raw):
    items = feed_chars(raw)
    assert not calls(items)
    assert texts(items) == raw


def test_a_call_cut_mid_value_keeps_only_complete_arguments():
    # max_tokens cut the second value: its half must not reach the tool.
    items = feed_chars('<tool_call>{"name": "Write", "arguments": {"path": "a.py", "content": "def f(')
    found = calls(items)
    assert found[0].input == {"path": "a.py"} and json.loads(found[0].json) == {"path": "a.py"}


def test_unclosed_but_complete_call_at_end_counts():
    items = feed_chars('<tool_call>\n{"name": "Bash", "arguments": "{\\"command\\": \\"ls\\"}"}\n')
    found = calls(items)
    assert found and found[0].input == {"command": "ls"}


def test_text_that_only_looks_like_a_tag_is_released():
    assert texts(feed_chars("a <tool x> <tool_cal")) == "a <tool x> <tool_cal"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_vocab()


def test_reply_builder_events_for_text_then_tool(tokenizer):
    im_end = tokenizer.token_to_id("<|im_end|>")
    builder = ReplyBuilder(tokenizer, (im_end,), [])
    events = []
    for token in tokenizer.encode("Sure. " + CALL) + [im_end]:
        events += builder.push([token])
    events += builder.finish()
    kinds = [(e["type"], e.get("content_block", e.get("delta", {})).get("type")) for e in events]
    assert kinds[0] == ("content_block_start", "text")
    assert ("content_block_start", "tool_use") in kinds
    tool_json = "".join(
        e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"
    )
    assert json.loads(tool_json) == {"path": "a.py"}
    assert kinds[-1] == ("content_block_stop", None)
    assert builder.called_tool
    assert builder.content[0] == {"type": "text", "text": "Sure. "}
    assert builder.content[1]["name"] == "Read"


def test_a_stop_sequence_that_spans_pushes_is_found(tokenizer):
    builder = ReplyBuilder(tokenizer, (), ["STOP", "END"])
    for piece in ["abc", " ST", "OP more"]:
        builder.push(tokenizer.encode(piece))
    builder.finish()
    assert builder.stop_sequence == "STOP" and builder.content == [{"type": "text", "text": "abc "}]


def test_stop_sequences_apply_to_the_replys_text_not_to_call_markup(tokenizer):
    """Matched on the raw output, a stop sequence in a call's markup (a newline after
    <tool_call>) dropped the call and showed its markup as text. Text the parser holds as a
    possible call and then gives back is matched when given back (at the latest at the end)."""
    newline = ReplyBuilder(tokenizer, (), ["\n"])
    newline.push(tokenizer.encode("Reading. " + CALL + " then\nmore"))
    newline.finish()
    assert [b["type"] for b in newline.content] == ["text", "tool_use", "text"]
    assert newline.content[1]["input"] == {"path": "a.py"} and newline.content[2]["text"] == " then"
    held = ReplyBuilder(tokenizer, (), ["##"])
    for token in tokenizer.encode("See <tool_call> is the tag. ## rest"):
        held.push([token])
    held.finish()
    assert held.stop_sequence == "##" and held.done
    assert held.content == [{"type": "text", "text": "See <tool_call> is the tag. "}]


def test_reply_builder_stop_sequence_and_multibyte(tokenizer):
    builder = ReplyBuilder(tokenizer, (), ["##"])
    for token in tokenizer.encode("héllo ✓ wörld ## rest"):
        builder.push([token])
    builder.finish()
    assert builder.done and builder.stop_sequence == "##"
    assert builder.content == [{"type": "text", "text": "héllo ✓ wörld "}]


def test_a_stop_sequence_found_only_at_finish_ends_the_reply(tokenizer):
    """The last tokens end in half a character, so the detokenizer holds their text back, stop
    sequence included, until finish(): the reply is cut there too (done), or its generated ids,
    text past the stop included, were remembered as the turn the client echoes back."""
    builder = ReplyBuilder(tokenizer, (), ["STOP"])
    builder.push(tokenizer.encode("Hi"))
    half_a_character = tokenizer.encode("é")[:1]  # one byte of two
    assert tokenizer.decode(half_a_character).endswith("\ufffd")
    builder.push(tokenizer.encode(" STOP ") + half_a_character)
    builder.finish()
    assert builder.stop_sequence == "STOP" and builder.done
    assert builder.content == [{"type": "text", "text": "Hi "}]


@pytest.mark.parametrize(
    "after",
    [" then <tool", ' then <tool_call>\n{"name": "Read", "arguments": {"path": "b.py"'],
    ids=["a marker begun", "a second call begun"],
)
def test_one_call_asked_for_ends_the_reply_even_when_more_arrived_at_once(tokenizer, after):
    """disable_parallel_tool_use: tokens pushed together carry the call and what follows; what
    the parser still held went out at finish() (a stray text block, or a crash on a call's
    arguments with no block open)."""
    builder = ReplyBuilder(tokenizer, (), [], one_call=True)
    events = builder.push(tokenizer.encode(CALL + after)) + builder.finish()
    assert [block["type"] for block in builder.content] == ["tool_use"]
    assert builder.content[0]["input"] == {"path": "a.py"} and builder.one_call_done
    assert not [e for e in events if e.get("content_block", {}).get("type") == "text"]


def test_a_stop_sequence_inside_a_calls_arguments_does_not_cut_the_call(tokenizer):
    """Stop sequences end the reply's text; matched over the raw output, one that a call's
    arguments held (a command that echoes it) cut the call there and sent it truncated."""
    command = 'git commit -m "## Summary"'
    call = (
        '<tool_call>\n{"name": "Bash", "arguments": {"command": ' + json.dumps(command) + "}}\n</tool_call>"
    )
    for split in (1, 3):  # token by token, and three tokens a push
        builder = ReplyBuilder(tokenizer, (), ["##"])
        ids = tokenizer.encode("Committing. " + call + " Done ## and more")
        for at in range(0, len(ids), split):
            builder.push(ids[at : at + split])
        builder.finish()
        assert builder.content[1] == {
            "type": "tool_use",
            "id": builder.content[1]["id"],
            "name": "Bash",
            "input": {"command": command},
        }
        assert builder.stop_sequence == "##" and builder.done
        assert [b.get("text") for b in builder.content] == ["Committing. ", None, " Done "]


def test_text_after_a_stray_opening_marker_streams_at_once():
    """A <tool_call> followed by anything but a JSON object is no call: its text went out only
    at the reply's end (a silent stream until then); now as soon as that is known, and the text
    after it is read as text again (a real call after it still counts)."""
    parser = HermesFormat().new_parser([])
    assert parser.feed("<tool_call>\n ") == []  # still may be a call
    assert texts(parser.feed("I will")) == "<tool_call>\n I will"
    assert texts(parser.feed(" read it.")) == " read it."
    items = parser.feed(CALL) + parser.finish()
    assert [(c.name, c.input) for c in calls(items)] == [("Read", {"path": "a.py"})]


def test_a_stop_sequence_after_a_stray_opening_marker_ends_generation_at_once(tokenizer):
    """The stop sequence was found only when the parser gave the held text back at finish():
    the engine kept generating up to max_tokens for a reply already over."""
    builder = ReplyBuilder(tokenizer, (), ["STOP"])
    builder.push(tokenizer.encode("Hi <tool_call> no json STOP"))
    assert builder.done and builder.stop_sequence == "STOP"  # before finish()
    builder.push(tokenizer.encode(" more"))
    builder.finish()
    assert builder.content == [{"type": "text", "text": "Hi <tool_call> no json "}]
