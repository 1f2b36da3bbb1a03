"""The role markers of a model's chat template, as strings around one message.

Rendering works message by message (so that each message's tokens can be cached and reused), so
the template is reduced to: an optional start-of-text, a prefix and a suffix per role, and the
generation prompt. ChatML models (SmolLM2, Qwen) are recognised by their special tokens; other
templates are probed by rendering them with jinja2 around sentinel contents and splitting the
result at the end-of-turn token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

ROLES = ("system", "user", "assistant")

logger = logging.getLogger("ikcode.gateway")


class TokenizerLike(Protocol):
    """What the gateway needs from a tokenizer (ikcode.model.tokenizer.Tokenizer has it)."""

    def encode(self, text: str, allow_special: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...


@dataclass(frozen=True)
class ChatFormat:
    prefix: dict[str, str]  # role -> text before the content
    suffix: dict[str, str]  # role -> text after the content
    generation_prompt: str  # opens the assistant turn the model writes
    start: str = ""  # once at the very beginning (a BOS the template writes)
    end_of_turn: str = ""  # the token that closes a turn (a stop token)
    name: str = "chatml"
    extra: dict[str, Any] = field(default_factory=dict)
    # The template has no system turn and writes the system prompt at the start of a user turn
    # (Gemma, Mistral): prefix["system"] is that turn's opening, suffix["system"] what separates
    # the system prompt from the user's words, and the first user turn after it has no prefix.
    system_opens_user_turn: bool = False


# Roles of their own (their own markers and segment keys) for templates without a system turn
OPENED_USER_TURN = "user, opened by the system prompt"
SYSTEM_AS_USER_TURN = "system, as a user turn"


def turn_role(fmt: ChatFormat, role: str, opens_after_system: bool) -> str:
    """The markers a turn is written with: its role's, but where the template has no system turn
    (ChatFormat.system_opens_user_turn): the first user turn after the system prompt goes on the
    turn it opened, and a system message among the messages is a user turn."""
    if role == "user" and opens_after_system:
        return OPENED_USER_TURN
    if role == "system" and fmt.system_opens_user_turn:
        return SYSTEM_AS_USER_TURN
    return role


def chatml_format() -> ChatFormat:
    prefix = {role: f"<|im_start|>{role}\n" for role in ROLES}
    suffix = {role: "<|im_end|>\n" for role in ROLES}
    return ChatFormat(prefix, suffix, "<|im_start|>assistant\n", end_of_turn="<|im_end|>")


def derive_chat_format(tokenizer: TokenizerLike, chat_template: str | None = None) -> ChatFormat:
    """ChatML when the vocabulary has its markers, else probe the template, else ChatML with a
    warning: a model prompted in a format it was not trained on answers, but badly, and nothing
    else would say why."""
    if tokenizer.token_to_id("<|im_start|>") is not None and tokenizer.token_to_id("<|im_end|>") is not None:
        return chatml_format()
    why = "the model file has no chat template"
    if chat_template:
        try:
            return probe_template_or_raise(chat_template, _special_strings(tokenizer))
        except TemplateProbeError as exc:
            why = f"its chat template could not be read ({exc})"
    logger.warning(
        "prompting the model in ChatML, which its vocabulary does not mark: %s; answers may be poor", why
    )
    return chatml_format()


def _special_strings(tokenizer: TokenizerLike) -> dict[str, str]:
    """bos_token / eos_token as the template sees them, from the tokenizer's strings or ids."""
    specials = {}
    for name in ("bos_token", "eos_token"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, str):
            specials[name] = value
    bos_id = getattr(tokenizer, "bos_token_id", None)
    eos_ids = getattr(tokenizer, "eos_token_ids", None) or ()
    if "bos_token" not in specials and isinstance(bos_id, int):
        specials["bos_token"] = tokenizer.decode([bos_id])
    if "eos_token" not in specials and eos_ids:
        specials["eos_token"] = tokenizer.decode([eos_ids[0]])
    return specials


_SENTINEL = {"system": "\x01SYS\x01", "user": "\x01USR\x01", "assistant": "\x01AST\x01"}


class TemplateProbeError(ValueError):
    """A chat template that does not render, or whose turns cannot be told apart."""


def probe_template(chat_template: str, specials: dict[str, str]) -> ChatFormat | None:
    """Render [system, user, assistant, user] with sentinels and cut the markers out; None when
    the template does not render or its turns cannot be told apart."""
    try:
        return probe_template_or_raise(chat_template, specials)
    except TemplateProbeError:
        return None


def probe_template_or_raise(chat_template: str, specials: dict[str, str]) -> ChatFormat:
    """probe_template, raising TemplateProbeError with the reason instead of returning None."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        # What transformers' apply_chat_template provides (gpt-oss's template dates its system turn).
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        template = env.from_string(chat_template)
    except Exception as exc:  # a template we cannot compile
        raise TemplateProbeError(f"it does not render: {type(exc).__name__}: {str(exc)[:200]}") from exc
    bos = specials.get("bos_token") or ""

    def render(order: list[str]) -> tuple[str, str, list[str]]:
        """(text, generation prompt, the texts before, between and after the messages) of a
        conversation in `order`."""
        messages = [{"role": r, "content": _SENTINEL[r] + str(i)} for i, r in enumerate(order)]
        try:
            text = template.render(messages=messages, add_generation_prompt=True, **specials)
            without_gen = template.render(messages=messages, add_generation_prompt=False, **specials)
        except Exception as exc:  # a template we cannot run (any jinja2 or template error)
            raise TemplateProbeError(f"it does not render: {type(exc).__name__}: {str(exc)[:200]}") from exc
        pieces, pos = [], 0
        for i, role in enumerate(order):
            at = without_gen.find(_SENTINEL[role] + str(i), pos)
            if at < 0:
                raise TemplateProbeError(f"the {role} message does not appear where it was put")
            pieces.append(without_gen[pos:at])
            pos = at + len(_SENTINEL[role] + str(i))
        pieces.append(without_gen[pos:])
        generation_prompt = text[len(without_gen) :] if text.startswith(without_gen) else ""
        return without_gen, generation_prompt, pieces

    try:
        _, generation_prompt, (head, *between, tail) = render(["system", "user", "assistant", "user"])
    except TemplateProbeError:  # the system prompt may go elsewhere (Mistral: the last user turn)
        return _probe_system_in_user_turn(render, bos, specials)
    # A turn ends at its end-of-turn token; whitespace after it still belongs to the turn. Some
    # templates end only the assistant's turns (DeepSeek: <｜User｜>...<｜Assistant｜>...<eos>).
    eot = _end_of_turn(between[1:], specials.get("eos_token"))
    sys_suffix, user_prefix = _split_at(between[0], eot)
    user_suffix, asst_prefix = _split_at(between[1], eot, tail)
    asst_suffix, next_user_prefix = _split_at(between[2], eot)
    start = bos if bos and head.startswith(bos) else ""
    sys_prefix = head[len(start) :]
    if not sys_suffix and sys_prefix and sys_prefix == next_user_prefix != user_prefix:
        # No end between the system prompt and the user's words, and the system prompt opens as
        # a user turn does (Gemma): it is written inside the first user turn.
        return _probe_system_in_user_turn(render, bos, specials)
    return _probed(
        (sys_prefix, sys_suffix), (user_prefix, user_suffix), (asst_prefix, asst_suffix),
        generation_prompt, start, eot,
    )  # fmt: skip


def _probe_system_in_user_turn(render: Any, bos: str, specials: dict[str, str]) -> ChatFormat:
    """A template without a system turn: the turns' markers from a conversation without a system
    prompt, and where the system prompt goes from [system, user]. It goes at the start of the
    first user turn, where a prefix cache keeps it (Mistral's template writes it into the last
    one, which moves every turn)."""
    _, generation_prompt, (head, *between, tail) = render(["user", "assistant", "user"])
    eot = _end_of_turn(between, specials.get("eos_token"))
    user_suffix, asst_prefix = _split_at(between[0], eot, tail)
    asst_suffix, user_prefix = _split_at(between[1], eot)
    start = bos if bos and head.startswith(bos) else ""
    _, _, (sys_head, separator, _) = render(["system", "user"])
    if head[len(start) :] != user_prefix or sys_head != head:
        raise TemplateProbeError("the system prompt is written neither as a turn nor at a user turn's start")
    return _probed(
        (user_prefix, separator), (user_prefix, user_suffix), (asst_prefix, asst_suffix),
        generation_prompt, start, eot, system_opens_user_turn=True,
    )  # fmt: skip


def _probed(
    system: tuple[str, str],
    user: tuple[str, str],
    assistant: tuple[str, str],
    generation_prompt: str,
    start: str,
    eot: str,
    system_opens_user_turn: bool = False,
) -> ChatFormat:
    """A probed format from each role's (prefix, suffix). A template that writes no generation
    prompt gets the assistant turn's opening, unless that is only the space the template writes
    before a reply (Mistral's " "), which the model writes itself as part of its first token."""
    opening = assistant[0] if assistant[0].strip() else ""
    return ChatFormat(
        prefix={"system": system[0], "user": user[0], "assistant": assistant[0]},
        suffix={"system": system[1], "user": user[1], "assistant": assistant[1]},
        generation_prompt=generation_prompt or opening,
        start=start,
        end_of_turn=eot,
        name="probed",
        system_opens_user_turn=system_opens_user_turn,
    )


def _split_at(gap: str, eot: str, closing: str = "") -> tuple[str, str]:
    """The text between two messages: (the first turn's end, the next turn's opening).
    `closing`: what the template writes after a turn of the first's role when it is the last
    (Mistral's user turns end in [/INST], no end-of-turn token)."""
    if eot not in gap:  # a turn without an end marker: the gap is the next turn's opening
        return (closing, gap[len(closing) :]) if closing and gap.startswith(closing) else ("", gap)
    cut = gap.find(eot) + len(eot)
    while cut < len(gap) and gap[cut] in "\n ":
        cut += 1
    return gap[:cut], gap[cut:]


def _end_of_turn(gaps: list[str], eos: str | None) -> str:
    """The end-of-turn token: the first known one in the first gap between turns that has one
    (the user's turn's end, or else the assistant's)."""
    for gap in gaps:
        for candidate in (eos, "<|eot_id|>", "<|im_end|>", "<|end|>", "</s>", "<end_of_turn>"):
            if candidate and candidate in gap:
                return candidate
    raise TemplateProbeError("no end-of-turn token between the turns")


def _raise_exception(message: str) -> None:
    raise ValueError(message)
