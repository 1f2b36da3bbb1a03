"""The previous render of a conversation, and how many of its turns a new request repeats.

A warm turn of a long conversation resends every earlier message. Finding their tokens in the
segment store means digesting each one (its text built from the blocks, its tool inputs dumped
as JSON, ~3 MB hashed for a 450K-token conversation: ~16 ms here), while comparing the messages
with the previous request's costs ~1 ms (the strings compare at memcmp speed). So the renderer
keeps each conversation's previous turns and tokens, and a new request takes the tokens of the
leading turns that compare equal from there.

Equal must mean "renders to the same tokens". Python's == holds for 1 == 1.0 == True and for dicts
in another key order, which json.dumps renders differently, so the JSON values a turn renders
(tool inputs, the definitions of deferred tools a tool search loaded) are compared strictly. What
else a turn's rendering reads is compared too: the system segment (by its chain digest) and the
tool names printed beside results. The first turn where anything differs ends the reuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import takewhile
from typing import Any

Turn = tuple[str, Any]  # (role, content) after consecutive assistant messages are merged
# What the turns' rendering read besides their own content, in turn order (see turn_reads).
TurnReads = tuple[list[tuple[int, int, Any]], list[tuple[int, str, str]], list[tuple[int, str, Any]]]


@dataclass(frozen=True)
class PreviousRender:
    head_chain: bytes  # chain digest after the start and system segments
    num_head_boundaries: int  # boundaries before the first turn's (1 with a system segment, else 0)
    turns: list[Turn]  # the closed turns, each with a boundary (a prefill's open turn is not kept)
    token_ids: list[int]  # the whole prompt (never mutated: the request and the engine hold it too)
    boundaries: list[tuple[bytes, int]]
    # What the turns' rendering read besides their own content, in turn order:
    tool_inputs: list[tuple[int, int, Any]]  # (turn, block, the tool_use's input): rendered as JSON
    result_names: list[tuple[int, str, str]]  # (turn, tool_use id, tool name printed beside its result)
    loaded_tools: list[tuple[int, str, Any]]  # (turn, deferred tool a tool search loaded, its Tool)
    # What it counts against the store's budget, in tokens: its prompt's, or its request's bytes
    # at ~4 a token where they are more (the turns it keeps are that request, parsed: an image
    # renders as a few tokens but keeps its megabytes of base64, and so do fields nobody reads).
    weight: int = 0

    def reusable_turns(
        self, head_chain: bytes, turns: list[Turn], names: dict[str, str], deferred: dict[str, Any]
    ) -> int:
        """How many leading turns of `turns` render exactly as this render's did."""
        if head_chain != self.head_chain:
            return 0
        # A final assistant turn is a prefill, rendered open: it cannot take a closed turn's tokens.
        limit = min(len(self.turns), len(turns) - (turns[-1][0] == "assistant"))
        num_turns = len(list(takewhile(bool, map(same_turn, turns[:limit], self.turns))))
        for turn, block, tool_input in self.tool_inputs:
            if turn >= num_turns:
                break
            if not same_json(turns[turn][1][block].input, tool_input):
                num_turns = turn
                break
        for turn, tool_use_id, name in self.result_names:
            if turn >= num_turns:
                break
            if names.get(tool_use_id, "") != name:
                num_turns = turn
                break
        for turn, tool_name, tool in self.loaded_tools:
            if turn >= num_turns:
                break
            if not same_tool(deferred.get(tool_name), tool):
                num_turns = turn
                break
        return num_turns

    def reads_before(self, num_turns: int) -> TurnReads:
        return (
            [read for read in self.tool_inputs if read[0] < num_turns],
            [read for read in self.result_names if read[0] < num_turns],
            [read for read in self.loaded_tools if read[0] < num_turns],
        )

    def end_of_turns(self, num_turns: int) -> tuple[bytes, int]:
        """(chain digest, token count) after the first num_turns turns (num_turns >= 1)."""
        return self.boundaries[self.num_head_boundaries + num_turns - 1]


def turn_reads(
    turn: int, role: str, content: Any, names: dict[str, str], deferred: dict[str, Any]
) -> TurnReads:
    """What rendering this turn reads that == on its content does not pin down exactly: its tool
    inputs (JSON), the names printed beside its results, the deferred tools its results load."""
    if isinstance(content, str):
        return [], [], []
    if role == "assistant":
        calls = [
            (turn, index, block.input)
            for index, block in enumerate(content)
            if getattr(block, "type", None) in ("tool_use", "server_tool_use")
        ]
        return calls, [], []
    if role != "user":
        return [], [], []
    results = [block for block in content if block.type == "tool_result"]
    loaded = [
        (turn, block.tool_name, deferred.get(block.tool_name))
        for result in results
        if isinstance(result.content, list)
        for block in result.content
        if block.type == "tool_reference"
    ]
    return [], [(turn, r.tool_use_id, names.get(r.tool_use_id, "")) for r in results], loaded


def same_turn(a: Turn, b: Turn) -> bool:
    """Role and content equal, block by block. A block's fields and extra fields compare as
    dicts: what pydantic's __eq__ does, without its per-call overhead (0.34 ms instead of 0.5 ms
    for 640 turns here, and one pass where comparing slices needed a bisection)."""
    if a[0] != b[0]:
        return False
    content, other = a[1], b[1]
    if isinstance(content, str) or isinstance(other, str):
        return content == other
    return len(content) == len(other) and all(map(_same_block, content, other))


def _same_block(a: Any, b: Any) -> bool:
    return (
        type(a) is type(b)
        and a.__dict__ == b.__dict__
        and getattr(a, "__pydantic_extra__", None) == getattr(b, "__pydantic_extra__", None)
    )


def same_tool(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return (
        a.name == b.name
        and same_json(a.description, b.description)
        and same_json(a.input_schema, b.input_schema)
    )


def same_json(a: Any, b: Any) -> bool:
    """a and b dump to the same JSON: same types, same key order, same float spelling."""
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        return len(a) == len(b) and all(
            ka == kb and same_json(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    if type(a) is list:
        return len(a) == len(b) and all(map(same_json, a, b))
    if type(a) is float:
        return repr(a) == repr(b)  # 0.0 == -0.0, but they dump differently
    return a == b
