"""Templates without a system turn (Gemma, Mistral) write the system prompt at the start of a user
turn. Probed as if it were a turn of its own, Gemma's every later user turn opened with the
system prompt's separator instead of `<start_of_turn>user`, and Mistral's template (which writes
it into the last user turn) could not be read at all: the model was prompted in ChatML."""

from __future__ import annotations

from ikcode.gateway.render import Renderer
from ikcode.gateway.schemas import MessagesRequest
from ikcode.model.tokenizer import Tokenizer
from tests.test_tool_formats import load_template, render_template

SYSTEM, FIRST, REPLY, SECOND = "Be brief.", "What is 2+2?", "4.", "And 3+3?"


def rendered_text(template: str, bos: str, eos: str, markers: tuple[str, ...]) -> str:
    tokenizer = Tokenizer.from_vocab(
        special_tokens=("<|endoftext|>", bos, eos, *markers), eos_tokens=(eos,), chat_template=template
    )
    tokenizer.bos_token_id = tokenizer.token_to_id(bos)
    renderer = Renderer(tokenizer)
    assert renderer.format.name == "probed" and renderer.format.system_opens_user_turn
    messages = [
        {"role": "user", "content": FIRST},
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": SECOND},
    ]
    body = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "system": SYSTEM, "messages": messages}
    )
    return tokenizer.decode(
        renderer.render(body.system, body.tools, body.tool_choice, body.messages).token_ids
    )


def conversation(first: str, system: str | None = None) -> list[dict]:
    head = [{"role": "system", "content": system}] if system is not None else []
    return head + [
        {"role": "user", "content": first},
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": SECOND},
    ]


def test_gemma_prompt_is_the_templates_byte_for_byte():
    template = load_template("gemma3.jinja")
    markers = ("<start_of_turn>", "<end_of_turn>")
    ours = rendered_text(template, "<bos>", "<eos>", markers)
    theirs = render_template(
        template, conversation(FIRST, SYSTEM), None, bos_token="<bos>", eos_token="<eos>"
    )
    assert ours == theirs
    assert ours.count("<start_of_turn>user\n") == 2


def test_mistral_system_prompt_opens_the_first_user_turn():
    """Where the template writes it into the last user turn (every turn would move it), it goes
    into the first, with the template's own markers and separator."""
    template = load_template("mistral.jinja")
    ours = rendered_text(template, "<s>", "</s>", ("[INST]", "[/INST]"))
    separator = "\\n\\n"  # what this template writes between the system prompt and the user's words
    folded = conversation(SYSTEM + separator + FIRST)
    theirs = render_template(template, folded, None, bos_token="<s>", eos_token="</s>")
    # A past reply opens as the generation prompt does (nothing after [/INST]): the space the
    # template writes before it is the model's own first token, which its remembered ids hold.
    assert ours == theirs.replace("[/INST] " + REPLY, "[/INST]" + REPLY)
    assert ours.endswith("[INST] " + SECOND + "[/INST]")
    assert ours.startswith("<s>[INST] " + SYSTEM)


def renderer_for(template: str, bos: str, eos: str, markers: tuple[str, ...]) -> tuple[Renderer, Tokenizer]:
    tokenizer = Tokenizer.from_vocab(
        special_tokens=("<|endoftext|>", bos, eos, *markers), eos_tokens=(eos,), chat_template=template
    )
    tokenizer.bos_token_id = tokenizer.token_to_id(bos)
    return Renderer(tokenizer), tokenizer


def prompt_text(renderer: Renderer, tokenizer: Tokenizer, body: dict) -> str:
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body})
    ids = renderer.render(request.system, request.tools, request.tool_choice, request.messages).token_ids
    return tokenizer.decode(ids)


READ = {
    "name": "Read",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}


def test_mistral_tool_list_goes_before_the_turn_as_its_template_puts_it():
    """It went inside the [INST] the system prompt opened (and, with no system prompt, a
    separator followed it with nothing to separate)."""
    from ikcode.gateway.tool_formats import callable_tools

    template = load_template("mistral.jinja")
    markers = ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]")
    renderer, tokenizer = renderer_for(template, "<s>", "</s>", markers)
    hi = [{"role": "user", "content": "hi"}]
    specs = callable_tools(
        MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": hi, "tools": [READ]}).tools
    )
    extra = {"bos_token": "<s>", "eos_token": "</s>"}
    for system in (SYSTEM, None):
        body = {"messages": hi, "tools": [READ], **({"system": system} if system else {})}
        head = [{"role": "system", "content": system}] if system else []
        assert prompt_text(renderer, tokenizer, body) == render_template(template, head + hi, specs, **extra)


def test_a_conversation_not_opened_by_the_user_gets_the_system_prompt_as_a_turn_of_its_own():
    """With a system or assistant message first, nothing closed the user turn the system prompt
    opened: the next turn was written inside it."""
    renderer, tokenizer = renderer_for(
        load_template("gemma3.jinja"), "<bos>", "<eos>", ("<start_of_turn>", "<end_of_turn>")
    )
    body = {
        "system": SYSTEM,
        "messages": [{"role": "assistant", "content": REPLY}, {"role": "user", "content": SECOND}],
    }
    assert prompt_text(renderer, tokenizer, body) == (
        f"<bos><start_of_turn>user\n{SYSTEM}<end_of_turn>\n<start_of_turn>model\n{REPLY}<end_of_turn>\n"
        f"<start_of_turn>user\n{SECOND}<end_of_turn>\n<start_of_turn>model\n"
    )
    body = {
        "system": SYSTEM,
        "messages": [{"role": "system", "content": "S2"}, {"role": "user", "content": SECOND}],
    }
    assert prompt_text(renderer, tokenizer, body) == (
        f"<bos><start_of_turn>user\n{SYSTEM}<end_of_turn>\n<start_of_turn>user\nS2<end_of_turn>\n"
        f"<start_of_turn>user\n{SECOND}<end_of_turn>\n<start_of_turn>model\n"
    )


def test_mistral_tool_choice_instruction_stays_inside_the_turn():
    """With the tool list moved before [INST], the tool_choice instruction went with it, outside
    any turn."""
    template = load_template("mistral.jinja")
    markers = ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]")
    renderer, tokenizer = renderer_for(template, "<s>", "</s>", markers)
    choice = {"type": "tool", "name": "Read"}
    hi = [{"role": "user", "content": "hi"}]
    for system in (SYSTEM, None):
        body = {
            "messages": hi,
            "tools": [READ],
            "tool_choice": choice,
            **({"system": system} if system else {}),
        }
        text = prompt_text(renderer, tokenizer, body)
        turn = text[text.index("[/AVAILABLE_TOOLS]") :]
        assert turn.startswith("[/AVAILABLE_TOOLS][INST] ") and turn.endswith("hi[/INST]")
        assert "You must call the function Read." in turn
