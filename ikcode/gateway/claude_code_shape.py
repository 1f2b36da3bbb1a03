"""Synthetic requests shaped like Claude Code's (for tests, benchmarks and health checks).

Built from the observed facts of Claude Code 2.1.197's first `-p` request: 24 tools whose JSON
schemas total ~63K characters (one alone ~21K), a billing attribution line in system[0], a ~6K
character system prompt, a ~6.6K character first user message, `cache_control` markers on
system[1], system[2] and the last block of the last user message, `thinking: adaptive`,
`max_tokens: 32000`, `stream: true`. Text is deterministic pseudo-prose; `scale` shrinks every
size (tests with a byte-level vocabulary use ~0.25 to land near 18K tokens).
"""

from __future__ import annotations

import copy
import random
from typing import Any

TOOL_NAMES = (
    "Task", "Bash", "Glob", "Grep", "ExitPlanMode", "Read", "Edit", "Write", "NotebookEdit", "WebFetch",
    "TodoWrite", "WebSearch", "BashOutput", "KillShell", "Skill", "SlashCommand", "AskUserQuestion",
    "ListMcpResources", "ReadMcpResource", "EnterPlanMode", "LSP", "TaskOutput", "MultiEdit", "LS",
)  # fmt: skip
_WORDS = (
    "the file path tool command output should must use when you run read write edit search result "
    "directory pattern string number boolean optional required description parameter user project code "
    "function return value line content match before after timeout background agent task plan status "
    "error message absolute relative glob regex include exclude limit offset context session model"
).split()
_ACK_CHARS = 240


def prose(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(_WORDS)
        words.append(word + ("." if rng.random() < 0.08 else ""))
        size += len(word) + 1
    return " ".join(words)[:chars]


def _tool(rng: random.Random, name: str, chars: int) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    n_props = max(1, min(8, chars // 600))
    for i in range(n_props):
        properties[f"{rng.choice(_WORDS)}_{i}"] = {
            "type": rng.choice(["string", "number", "boolean"]),
            "description": prose(rng, chars // (2 * n_props)),
        }
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties)[:1],
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    }
    return {"name": name, "description": prose(rng, chars // 2), "input_schema": schema}


def claude_code_tools(scale: float = 1.0, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    sizes = [int(21_000 * scale)] + [int(42_000 * scale / 23)] * 23
    return [_tool(rng, name, size) for name, size in zip(TOOL_NAMES, sizes, strict=True)]


def claude_code_request(scale: float = 1.0, seed: int = 0, billing_hex: str = "a1b") -> dict[str, Any]:
    """The first request of a conversation: system, 24 tools, one user message."""
    rng = random.Random(seed + 1)
    marker = {"type": "ephemeral"}
    system = [
        {
            "type": "text",
            "text": f"x-anthropic-billing-header: cc_version=2.1.197.{billing_hex}; cc_entrypoint=sdk-cli;",
        },
        {
            "type": "text",
            "text": "You are Claude Code, a command line coding agent.",
            "cache_control": marker,
        },
        {"type": "text", "text": prose(rng, int(6_000 * scale)), "cache_control": marker},
    ]
    first = [
        {
            "type": "text",
            "text": "<system-reminder>\n" + prose(rng, int(6_300 * scale)) + "\n</system-reminder>",
        },
        {"type": "text", "text": "List the Python files and read the main one.", "cache_control": marker},
    ]
    return {
        "model": "claude-opus-4-8",
        "messages": [{"role": "user", "content": first}],
        "system": system,
        "tools": claude_code_tools(scale, seed),
        "metadata": {"user_id": '{"device_id": "d", "session_id": "s"}'},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }


def with_turn(
    request: dict[str, Any], assistant_content: list[dict[str, Any]], user_content: list[dict[str, Any]]
) -> dict[str, Any]:
    """The next request: the reply as the client echoes it, then a new user message.

    Like Claude Code, the cache_control marker moves to the newest user block.
    """
    grown = copy.deepcopy(request)
    for message in grown["messages"]:
        if isinstance(message["content"], list):
            for block in message["content"]:
                block.pop("cache_control", None)
    user_content = copy.deepcopy(user_content)
    user_content[-1]["cache_control"] = {"type": "ephemeral"}
    grown["messages"] += [
        {"role": "assistant", "content": assistant_content},
        {"role": "user", "content": user_content},
    ]
    return grown


def tool_round(rng: random.Random, index: int, result_chars: int) -> tuple[list[dict], list[dict]]:
    """One tool_use / tool_result exchange with a file-sized result."""
    tool_id = f"toolu_{index:04d}{rng.randrange(16**8):08x}"
    assistant = [
        {"type": "text", "text": prose(rng, _ACK_CHARS)},
        {"type": "tool_use", "id": tool_id, "name": "Read", "input": {"file_path": f"/repo/src/m{index}.py"}},
    ]
    user = [{"type": "tool_result", "tool_use_id": tool_id, "content": prose(rng, result_chars)}]
    return assistant, user


def long_conversation(rounds: int, result_chars: int, scale: float = 1.0, seed: int = 0) -> dict[str, Any]:
    """A long agent session: the first request plus `rounds` tool exchanges and a mid-conversation
    system message halfway."""
    rng = random.Random(seed + 2)
    request = claude_code_request(scale, seed)
    for i in range(rounds):
        assistant, user = tool_round(rng, i, result_chars)
        request = with_turn(request, assistant, user) if i == 0 else _append(request, assistant, user)
        if i == rounds // 2:
            request["messages"].append({"role": "system", "content": prose(rng, 300)})
    return request


def _append(request: dict[str, Any], assistant: list[dict], user: list[dict]) -> dict[str, Any]:
    request["messages"] += [{"role": "assistant", "content": assistant}, {"role": "user", "content": user}]
    return request
