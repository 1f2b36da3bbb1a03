"""gpt-oss (harmony): messages with channels; a call is a commentary message to=functions.NAME.

The model writes `<|channel|>analysis<|message|>...<|end|>` (its reasoning, not shown),
`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
(a call; the recipient may also come before the channel) and `<|channel|>final<|message|>...`
(the answer). vLLM reads calls the same way (openai_tool_parser.py @0558e31): a message whose
recipient starts with "functions." (:52; the name after it, :71), the "final" channel's text as
the answer (:76). Tool list (TypeScript-like), calls and results as gpt-oss's chat template writes
them (tests/data/chat_templates/gpt_oss.jinja); results are JSON strings. Known differences from
the template's whole prompt: its system message gains a line about the 'functions' channel when
there are tools, and it ends a past call with <|call|> where the turn here ends with <|end|>.
"""

from __future__ import annotations

import re
from typing import Any

from ikcode.gateway.tool_formats.base import (
    AssistantItem,
    CallItem,
    ParseEvent,
    ResultItem,
    TextPiece,
    ToolFormat,
    TurnMarkers,
    dumps,
)
from ikcode.gateway.tool_formats.json_args import CallAssembler, ObjectScanner
from ikcode.gateway.tool_formats.tagged import partial_suffix

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
_MESSAGE_ENDS = (END, CALL, RETURN, START)
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w+)")


def _ts_type(spec: Any) -> str:
    """A JSON schema as the template's render_typescript_type writes it (the common cases)."""
    if not isinstance(spec, dict):
        return "any"
    kind = spec.get("type")
    nullable = " | null" if spec.get("nullable") else ""
    if kind == "array":
        items = spec.get("items")
        if not items or not isinstance(items, dict):  # JSON Schema allows `true` or a list here
            return "any[]" + nullable
        simple = {"string": "string[]", "number": "number[]", "integer": "number[]", "boolean": "boolean[]"}
        if items.get("type") in simple:
            return simple[items["type"]] + nullable
        inner = _ts_type(items)
        return ("any[]" if inner == "object | object" or len(inner) > 50 else inner + "[]") + nullable
    if isinstance(kind, list) and kind:
        return " | ".join(map(str, kind))
    if kind == "string":
        if spec.get("enum"):
            return '"' + '" | "'.join(map(str, spec["enum"])) + '"'
        return "string" + nullable
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "object":
        properties = spec.get("properties")
        if not properties:
            return "object"
        required = spec.get("required") or []
        fields = [
            f"{name}{'' if name in required else '?'}: \n{' ' * 16}{_ts_type(field)}"
            for name, field in properties.items()
        ]
        return "{\n" + ", ".join(fields) + "}"
    return "any"


class HarmonyParser:
    def __init__(self) -> None:
        self._buf = ""
        self._header: str | None = ""  # None: inside a message's content
        self._call: CallAssembler | None = None
        self._scanner: ObjectScanner | None = None
        self._visible = False  # the current message's content is shown as text

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        out: list[ParseEvent] = []
        while self._buf:
            if self._header is not None:
                at = self._buf.find(MESSAGE)
                if at < 0:
                    return out
                self._open(self._header + self._buf[:at])
                self._buf = self._buf[at + len(MESSAGE) :]
                continue
            ends = [(self._buf.find(m), m) for m in _MESSAGE_ENDS if m in self._buf]
            at, marker = min(ends) if ends else (-1, "")
            if at < 0:
                keep = max(partial_suffix(self._buf, m) for m in _MESSAGE_ENDS)
                chunk, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                out += self._content(chunk)
                return out
            out += self._content(self._buf[:at]) + self._close_message(complete=True)
            self._buf = self._buf[at + (0 if marker == START else len(marker)) :]
            self._header = ""
        return out

    def _open(self, header: str) -> None:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        self._header, self._call, self._visible = None, None, False
        if recipient and recipient.group(1).startswith("functions."):
            self._call = CallAssembler()
            self._call.set_name(recipient.group(1)[len("functions.") :])
            self._scanner = ObjectScanner()
        else:  # the answer and commentary preambles are shown; analysis (reasoning) is not
            self._visible = channel is None or channel.group(1) != "analysis"

    def _content(self, text: str) -> list[ParseEvent]:
        if self._call is not None and self._scanner is not None:
            members, _ = self._scanner.feed(text)
            events: list[ParseEvent] = []
            for _, key, value in members:
                events += self._call.add(key, value)
            return events
        return [TextPiece(text)] if text and self._visible else []

    def _close_message(self, complete: bool) -> list[ParseEvent]:
        call, self._call = self._call, None
        if call is None:
            return []
        done = self._scanner is not None and self._scanner.state == "done"
        return call.close(complete and done) or []

    def finish(self) -> list[ParseEvent]:
        buf, self._buf = self._buf, ""
        if self._header is not None:  # never reached a message: show what there was
            text = self._header + buf
            self._header = ""
            if START in text or CHANNEL in text:  # a harmony header cut short: markup, not text
                return []
            return [TextPiece(text)] if text.strip() else []
        # The reply ends at <|call|> or <|return|> (stop tokens, so not in the text).
        return self._content(buf) + self._close_message(complete=True)


class HarmonyFormat(ToolFormat):
    name = "harmony"
    markers = (START, END, MESSAGE, CHANNEL, CALL, RETURN, CONSTRAIN)
    # <|end|> ends the analysis message before the answer or call: generation ends at <|return|>
    # or <|call|> (the tokenizer's end-of-generation set for this vocabulary).
    ends_messages_not_turns = (END,)

    def tools_text(self, tools: list[dict[str, Any]]) -> str:
        text = "# Tools\n\n## functions\n\nnamespace functions {\n\n"
        for tool in tools:
            function = tool["function"]
            text += f"// {function.get('description', '')}\ntype {function['name']} = "
            parameters = function.get("parameters") or {}
            properties = parameters.get("properties")
            if not properties:
                text += "() => any;\n\n"
                continue
            required = parameters.get("required") or []
            fields = []
            for name, spec in properties.items():
                spec = spec if isinstance(spec, dict) else {}
                optional = "" if name in required else "?"
                field = f"// {spec['description']}\n" if spec.get("description") else ""
                field += f"{name}{optional}: {_ts_type(spec)}"
                if "default" in spec:
                    default = str(spec["default"]) if spec.get("enum") else dumps(spec["default"])
                    field += ", // default: " + default
                fields.append(field)
            text += "(_: {\n" + ",\n".join(fields) + ",\n}) => any;\n\n"
        return text + "} // namespace functions"

    def call_text(self, call: CallItem) -> str:
        return f" to=functions.{call.name}{CHANNEL}commentary json{MESSAGE}{dumps(call.input)}"

    def assistant_text(self, items: list[AssistantItem]) -> str:
        # The turn opens with "<|start|>assistant" (the generation prompt) and closes with <|end|>.
        messages = []
        thinking = "\n".join(value for kind, value in items if kind == "thinking")
        if thinking:
            messages.append(f"{CHANNEL}analysis{MESSAGE}{thinking}")
        text = "\n".join(value for kind, value in items if kind == "text")
        calls = [value for kind, value in items if kind == "call"]
        if text and calls:  # the template puts text beside a call in the analysis channel
            messages.append(f"{CHANNEL}analysis{MESSAGE}{text}")
        elif text or not calls:
            messages.append(f"{CHANNEL}final{MESSAGE}{text}")
        messages += [self.call_text(call) for call in calls]
        return f"{END}{START}assistant".join(messages)

    def result_text(self, result: ResultItem) -> str:
        content = "Error: " + result.content if result.is_error else result.content
        return dumps(content)

    def result_turns(self, results: list[ResultItem]) -> list[tuple[TurnMarkers, str]] | None:
        return [
            (
                TurnMarkers(f"{START}functions.{r.name} to=assistant{CHANNEL}commentary{MESSAGE}", END),
                self.result_text(r),
            )
            for r in results
        ]

    def new_parser(self, tools: list[Any]) -> HarmonyParser:
        return HarmonyParser()
