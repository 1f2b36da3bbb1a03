"""JSON calls as they stream: object members found as they complete, sloppy JSON repaired.

A call's arguments are forwarded member by member: a member ("key": value) of the arguments object
is passed on once the comma or brace after it has arrived, and `CallAssembler` serialises it
canonically, so every piece is final and the pieces of a call concatenate to json.dumps(input). A
member that never completes (the reply was cut by max_tokens) is dropped, so a truncated value
(half a file for Write) never reaches a tool. Sloppy JSON (single quotes, trailing commas, Python
literals, unquoted keys) is repaired with json_repair, one member at a time.
"""

from __future__ import annotations

import json
from typing import Any

import json_repair

from ikcode.gateway.tool_formats.base import (
    ParseEvent,
    ToolArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    dumps,
    json_safe,
    new_tool_use_id,
)

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/Mistral say "arguments", Llama "parameters"


def loads_lenient(text: str) -> Any | None:
    """Strict JSON first; else what json_repair makes of it; None when nothing usable."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    if not text.strip():
        return None
    try:
        return json_repair.loads(text)
    except Exception:  # json_repair raises assorted errors on hopeless input
        return None


def arguments_object(value: Any) -> dict[str, Any] | None:
    """Arguments as a dict: some models double-encode them as a JSON string."""
    if isinstance(value, str):
        value = loads_lenient(value) if value.strip() else {}
    if value is None:
        return {}
    return value if isinstance(value, dict) else None


class CallAssembler:
    """One call: its name and its argument members in, Start / ArgsDelta / End events out.

    The call starts (ToolCallStart) once its name and one complete argument member are known, so
    text that merely opens a call tag does not become a tool_use block.
    """

    def __init__(self) -> None:
        self.id = new_tool_use_id()
        self.name: str | None = None
        self.started = False
        self._pending: list[tuple[str, Any]] = []
        self._input: dict[str, Any] = {}

    def set_name(self, name: Any) -> list[ParseEvent]:
        if isinstance(name, str) and name and self.name is None:
            self.name = name
        return self._flush()

    def add(self, key: Any, value: Any) -> list[ParseEvent]:
        self._pending.append((json_safe(str(key)), json_safe(value)))
        return self._flush()

    def _flush(self) -> list[ParseEvent]:
        if self.name is None or not self._pending:
            return []
        events: list[ParseEvent] = []
        if not self.started:
            self.started = True
            events.append(ToolCallStart(self.id, self.name))
        piece = ""
        for key, value in self._pending:
            piece += ("{" if not self._input and not piece else ", ") + dumps(key) + ": " + dumps(value)
            self._input[key] = value
        self._pending = []
        return events + [ToolArgsDelta(piece)]

    def close(self, complete: bool) -> list[ParseEvent] | None:
        """End the call; None when it never became one (the caller then shows the raw text)."""
        events = self._flush()
        if self.name is None or (not self.started and not complete):
            return None
        if not self.started:
            self.started = True
            events.append(ToolCallStart(self.id, self.name))
        events.append(ToolArgsDelta("}" if self._input else "{}"))
        return events + [ToolCallEnd(self._input)]


class ObjectScanner:
    """Scans one JSON object fed in pieces and reports each top-level member once complete.

    With `arguments_inside`, an "arguments"/"parameters" member whose value is an object is
    reported member by member as ("arg", key, value); every other member as ("member", key, value);
    an arguments value given as a string comes back as ("member", key, string).
    """

    def __init__(self, arguments_inside: bool = False) -> None:
        self.arguments_inside = arguments_inside
        self.state = "before"  # before -> inside -> done | failed
        self._depth = 0
        self._quote: str | None = None
        self._escape = False
        self._member: list[str] = []
        self._nested: ObjectScanner | None = None
        self._nested_key: str | None = None
        self._awaiting_value_of: str | None = None

    @property
    def in_string(self) -> bool:
        """Inside a string of the object, at any depth: a call's close marker there is text (a
        Write of a file that mentions the marker)."""
        if self.state != "inside":
            return False
        return self._quote is not None or (self._nested is not None and self._nested.in_string)

    def feed(self, text: str) -> tuple[list[tuple[str, Any, Any]], int]:
        """Members completed by `text`, and how many of its characters belong to the object."""
        out: list[tuple[str, Any, Any]] = []
        for at, ch in enumerate(text):
            if self.state in ("done", "failed"):
                return out, at
            if self.state == "before":
                if ch == "{":
                    self.state, self._depth = "inside", 1
                elif not ch.isspace():
                    self.state = "failed"
                continue
            if self._nested is not None:
                members, _ = self._nested.feed(ch)
                out += [("arg", key, value) for _, key, value in members]
                if self._nested.state == "done":  # the member ends at the next "," or "}"
                    self._nested, self._member = None, []
                continue
            if self._awaiting_value_of is not None and not ch.isspace():
                key, self._awaiting_value_of = self._awaiting_value_of, None
                if ch == "{":
                    self._nested = ObjectScanner()
                    self._nested.feed(ch)
                    self._nested_key = key
                    continue
            self._step(ch, out)
        return out, len(text)

    def _step(self, ch: str, out: list[tuple[str, Any, Any]]) -> None:
        if self._quote is not None:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == self._quote:
                self._quote = None
            self._member.append(ch)
            return
        if ch in "\"'":
            self._quote = ch
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._complete(out)
                self.state = "done"
                return
        elif ch == "," and self._depth == 1:
            self._complete(out)
            return
        elif ch == ":" and self._depth == 1 and self.arguments_inside:
            key = loads_lenient("".join(self._member).strip())
            if key in ARGUMENT_KEYS:
                self._awaiting_value_of = key
        self._member.append(ch)

    def _complete(self, out: list[tuple[str, Any, Any]]) -> None:
        raw, self._member = "".join(self._member), []
        if self._nested_key is not None:  # the arguments object already went out member by member
            out.append(("args_done", self._nested_key, None))
            self._nested_key = None
            return
        if not raw.strip():
            return
        value = loads_lenient("{" + raw + "}")
        if isinstance(value, dict):
            out += [("member", key, item) for key, item in value.items()]


class JsonCallParser:
    """One `{"name": ..., "arguments": {...}}` object (Hermes, Llama, Mistral), fed in pieces."""

    def __init__(self) -> None:
        self.call = CallAssembler()
        self.scanner = ObjectScanner(arguments_inside=True)
        self._bad = False
        self._arguments_seen = False

    @property
    def done(self) -> bool:
        return self.scanner.state in ("done", "failed")

    @property
    def has_arguments(self) -> bool:
        """An arguments member ("arguments", "parameters") has begun."""
        return self._arguments_seen

    def feed(self, text: str) -> tuple[list[ParseEvent], int]:
        members, used = self.scanner.feed(text)
        events: list[ParseEvent] = []
        for kind, key, value in members:
            if kind == "arg":
                self._arguments_seen = True
                events += self.call.add(key, value)
            elif kind == "args_done":
                self._arguments_seen = True
            elif key == "name":
                events += self.call.set_name(value)
            elif key in ARGUMENT_KEYS and not self._arguments_seen:
                self._arguments_seen = True
                arguments = arguments_object(value)
                if arguments is None:
                    self._bad = True
                for arg_key, arg_value in (arguments or {}).items():
                    events += self.call.add(arg_key, arg_value)
        return events, used

    def close(self) -> list[ParseEvent] | None:
        """End of the call's text: its events, or None when it was no call at all."""
        complete = self.scanner.state == "done" and not self._bad
        if self._bad and not self.call.started:
            return None
        return self.call.close(complete)
