"""A warm turn reuses the conversation's previous render: only what renders exactly the same.

Every render here is checked against the same renderer rendering the same request with no
conversation key (each turn digested and looked up on its own): the tokens and the boundaries
(which block hashing resumes from) must be identical, however the request differs from the
previous one, and the reused part must stop before the first turn that renders differently.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ikcode.gateway.render import Renderer
from ikcode.gateway.schemas import MessagesRequest
from ikcode.gateway.tool_formats import FORMATS
from ikcode.model.tokenizer import Tokenizer

TOOLS: list[dict[str, Any]] = [
    {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object"}},
    {"name": "Read", "description": "Read a file", "input_schema": {"type": "object"}},
    {
        "name": "Grep",
        "description": "Search files",
        "input_schema": {"type": "object", "properties": {"pattern": {"type": "string"}}},
        "defer_loading": True,
    },
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_vocab(merges=[("h", "e"), ("Ġ", "he"), ("l", "l"), ("o", "n")])


def tool_round(index: int, tool_input: dict[str, Any], result: Any) -> list[dict[str, Any]]:
    call_id = f"toolu_{index:04d}"
    return [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": f"step {index}"},
                {"type": "tool_use", "id": call_id, "name": "Bash", "input": tool_input},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}]},
    ]


def conversation(rounds: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "fix the failing test"}]
    messages += tool_round(0, {"command": "ls", "timeout": 1, "quiet": True, "delay_s": 0.0}, "a.py\nb.py")
    search = {"type": "tool_use", "id": "toolu_find", "name": "ToolSearch", "input": {"query": "grep"}}
    loaded = [{"type": "tool_reference", "tool_name": "Grep"}]
    messages += [
        {"role": "assistant", "content": [search]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_find", "content": loaded}],
        },
    ]
    for index in range(1, rounds):
        messages += tool_round(index, {"command": f"cat f{index}.py", "timeout": 2.5}, f"line {index}\n" * 3)
    messages.append({"role": "system", "content": "the user changed the working directory"})
    messages.append({"role": "user", "content": "go on"})
    return {"system": "You are a coding agent.", "tools": copy.deepcopy(TOOLS), "messages": messages}


def render(renderer: Renderer, body: dict[str, Any], conversation: Any = None):
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 10, **body})
    return renderer.render(request.system, request.tools, request.tool_choice, request.messages, conversation)


def checked(renderer: Renderer, body: dict[str, Any], conversation: Any = "c"):
    """Render with reuse, and check it against the render without."""
    rendered = render(renderer, body, conversation)
    reference = render(renderer, body)
    assert rendered.token_ids == reference.token_ids
    assert rendered.boundaries == reference.boundaries
    assert rendered.reply_prefix_key == reference.reply_prefix_key
    assert rendered.reused_tokens <= len(rendered.token_ids)
    return rendered


def turn_start(renderer: Renderer, body: dict[str, Any], message_index: int) -> int:
    """Token count before the given message (its turn's start) in a render of body."""
    before = dict(body, messages=body["messages"][:message_index] + [{"role": "user", "content": "x"}])
    return render(renderer, before).boundaries[-2][1]


@pytest.mark.parametrize("tool_format", ["hermes", "harmony"])
def test_growing_conversation_reuses_all_but_the_new_turns(tokenizer, tool_format):
    renderer = Renderer(tokenizer, tool_format=FORMATS[tool_format]())
    body = conversation(2)
    first = checked(renderer, body)
    assert first.reused_tokens == 0
    for rounds in range(3, 6):
        grown = conversation(rounds)
        rendered = checked(renderer, grown)
        assert rendered.reused_from is not None
        # Everything up to the previous request's last turn is reused; "go on" and the system
        # message moved, so the previous request's last turns are rendered again.
        assert rendered.reused_tokens == turn_start(renderer, grown, len(body["messages"]) - 2)
        assert rendered.fresh_tokens > 0
        body = grown
    again = checked(renderer, body)  # the same request again: every turn reused
    assert again.reused_tokens == len(again.token_ids) - len(renderer._gen_ids)
    assert again.fresh_tokens == 0


def edit(body: dict[str, Any], message_index: int, change) -> dict[str, Any]:
    edited = copy.deepcopy(body)
    change(edited["messages"][message_index]["content"])
    return edited


def set_input(key: str, value: Any):
    def change(content: list[dict[str, Any]]) -> None:
        content[1]["input"][key] = value

    return change


def reorder_input(content: list[dict[str, Any]]) -> None:
    content[1]["input"] = dict(reversed(content[1]["input"].items()))


EDITS = {
    # (message index the edit touches, how)
    "first message text": (0, None),
    "middle tool result": (6, None),
    "int to float in a tool input": (1, set_input("timeout", 1.0)),
    "bool to int in a tool input": (1, set_input("quiet", 1)),
    "0.0 to -0.0 in a tool input": (1, set_input("delay_s", -0.0)),
    "tool input keys reordered": (1, reorder_input),
    "a block added to a turn": (2, lambda content: content.append({"type": "text", "text": "also this"})),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_an_edited_earlier_turn_is_rendered_again(tokenizer, name):
    renderer = Renderer(tokenizer)
    body = conversation(5)
    checked(renderer, body)
    message_index, change = EDITS[name]
    if change is None:
        edited = copy.deepcopy(body)
        message = edited["messages"][message_index]
        if isinstance(message["content"], str):
            message["content"] += " (edited)"
        else:
            message["content"][0]["content"] += " (edited)"
    else:
        edited = edit(body, message_index, change)
    # The edit shows in a render from scratch (with this renderer's store, a reordered tool input
    # takes the tokens its first order had: the store knows the call by its canonical JSON).
    assert render(Renderer(tokenizer), edited).token_ids != render(Renderer(tokenizer), body).token_ids
    rendered = checked(renderer, edited)
    assert rendered.reused_tokens <= turn_start(renderer, edited, message_index)


@pytest.mark.parametrize("part", ["system", "tools", "tool_choice"])
def test_another_system_prompt_or_tool_list_reuses_nothing(tokenizer, part):
    renderer = Renderer(tokenizer)
    body = conversation(4)
    checked(renderer, body)
    changed = copy.deepcopy(body)
    if part == "system":
        changed["system"] = "You are a careful coding agent."
    elif part == "tools":
        changed["tools"][0]["description"] = "Run a shell command"
    else:
        changed["tool_choice"] = {"type": "any"}
    assert checked(renderer, changed).reused_tokens == 0


def test_a_loaded_deferred_tool_whose_definition_changed_is_rendered_again(tokenizer):
    """The tool search's result shows the deferred tool's definition; the system segment does not
    hold deferred tools, so only the turn-level check catches the change."""
    renderer = Renderer(tokenizer)
    body = conversation(4)
    checked(renderer, body)
    changed = copy.deepcopy(body)
    changed["tools"][2]["input_schema"]["properties"]["pattern"]["type"] = "array"
    rendered = checked(renderer, changed)
    assert 0 < rendered.reused_tokens <= turn_start(renderer, changed, 4)


def test_a_result_whose_printed_tool_name_changed_is_rendered_again(tokenizer):
    """harmony prints the tool's name beside its result, looked up by id over the whole request: a
    later turn that reuses an id under another name changes how the earlier result renders."""
    renderer = Renderer(tokenizer, tool_format=FORMATS["harmony"]())
    body = conversation(4)
    checked(renderer, body)
    changed = copy.deepcopy(body)
    changed["messages"] += [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_0000", "name": "Read", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0000", "content": "x"}]},
    ]
    rendered = checked(renderer, changed)
    assert rendered.reused_tokens <= turn_start(renderer, changed, 2)


def test_a_prefill_does_not_take_the_closed_turns_tokens(tokenizer):
    renderer = Renderer(tokenizer)
    body = conversation(3)
    checked(renderer, body)
    prefill = dict(body, messages=body["messages"][:4])  # ends with an assistant turn, left open
    assert prefill["messages"][-1]["role"] == "assistant"
    rendered = checked(renderer, prefill)
    assert rendered.reply_prefix_key is None
    assert 0 < rendered.reused_tokens <= turn_start(renderer, prefill, 3)


def test_conversations_are_kept_apart_by_key(tokenizer):
    """Two keys (users, sessions) never reuse each other's renders, and one key keeps a few
    conversations (a subagent beside its parent) without losing the parent's."""
    renderer = Renderer(tokenizer)
    parent, subagent = conversation(4), dict(conversation(2), system="You are a subagent.")
    checked(renderer, parent, ("alice", "s1"))
    assert checked(renderer, parent, ("bob", "s1")).reused_tokens == 0
    assert checked(renderer, parent, ("alice", "s2")).reused_tokens == 0
    checked(renderer, subagent, ("alice", "s1"))
    assert checked(renderer, conversation(5), ("alice", "s1")).reused_tokens > 0


@pytest.mark.parametrize("edited_indices", [(2,), (62,), (64,), (66,), (128,), (140,), (10, 100)])
def test_reuse_ends_exactly_at_the_first_edited_turn_of_a_long_conversation(tokenizer, edited_indices):
    renderer = Renderer(tokenizer)
    body = conversation(72)  # 148 messages: the turns are compared in several slices
    checked(renderer, body)
    edited = copy.deepcopy(body)
    for message_index in edited_indices:
        message = edited["messages"][message_index]
        assert message["role"] == "user" and isinstance(message["content"], list)
        message["content"][0]["content"] = "(edited)"
    rendered = checked(renderer, edited)
    assert rendered.reused_tokens == turn_start(renderer, edited, edited_indices[0])


@pytest.mark.parametrize("first", ["padded", "plain"])
def test_an_assistant_turn_is_tokenized_as_sent_whatever_was_sent_before(tokenizer, first):
    """Turns that differ only in their surrounding whitespace shared one remembered tokenization
    (the key stripped it): the prompt then depended on what anyone sent before."""
    plain, padded = "sure, here it is", "sure, here it is" + "\n" * 40

    def body(reply: str) -> dict[str, Any]:
        messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": reply}]
        return {"messages": [*messages, {"role": "user", "content": "ok"}]}

    shared = Renderer(tokenizer)
    order = [padded, plain] if first == "padded" else [plain, padded]
    for reply in order:
        alone = render(Renderer(tokenizer), body(reply)).token_ids
        assert render(shared, body(reply)).token_ids == alone
