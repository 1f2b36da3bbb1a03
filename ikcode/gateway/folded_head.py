"""The prompt's head where the template has no system turn (ChatFormat.system_opens_user_turn):
the system prompt opens the first user turn, with the template's separator before the user's
words, and that turn then renders without its own opening.

When the conversation does not begin with a user message (a system or assistant message first),
nothing follows to close an opened turn: the system prompt is then a user turn of its own. A
format whose tool list precedes the turn in its template (Mistral's [AVAILABLE_TOOLS] before
[INST]) gets it there, ahead of the turn's opening, never inside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ikcode.gateway.chat_format import ChatFormat
from ikcode.gateway.prompt_chain import digest
from ikcode.gateway.tool_formats import ToolFormat


@dataclass
class FoldedHead:
    key: bytes
    parts: list[tuple[str, str, str]]  # (markers before, text, markers after), in order
    opens_user_turn: bool  # the first user turn goes on inside it


def folded_head(
    fmt: ChatFormat, tool_format: ToolFormat, system: str, tools_text: str, choice: str, opens_turn: bool
) -> FoldedHead | None:
    """The head's parts: system, tools_text and choice are the (guarded) system prompt, tool
    list and tool_choice instruction; opens_turn: the first message is a user message."""
    if tools_text and tool_format.tools_before_turns:  # the instruction stays inside the turn
        lead, text = tools_text, "\n\n".join(t for t in (system, choice) if t)
    else:
        listed = tools_text + ("\n\n" + choice if choice else "")
        lead, text = "", tool_format.system_text(system, listed) if tools_text else system
    if not (lead or text):
        return None
    parts = [("", lead, "")] if lead else []
    if opens_turn:
        parts.append((fmt.prefix["system"], text, fmt.suffix["system"] if text else ""))
    elif text:
        parts.append((fmt.prefix["system"], text, fmt.suffix["user"]))
    key = digest(b"folded system\x00" + json.dumps(parts).encode())
    return FoldedHead(key, parts, opens_turn)
