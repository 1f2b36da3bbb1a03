"""Tool-call formats, one module per model family, chosen from the model's chat template.

`detect_tool_format` looks for each family's markers in the template (the strings its calls are
written with); a profile can name the format instead (`[model] tool_format`). Templates without
any of them get Hermes, the format small open models are most often trained on.

Each module cites the lines of vLLM's parser for its family (vllm-project/vllm,
vllm/entrypoints/openai/tool_parsers/*.py at the commit named) that read the same markers.
"""

from __future__ import annotations

from ikcode.gateway.tool_formats.base import (
    CallItem,
    ParseEvent,
    ResultItem,
    StreamParser,
    TextOnlyParser,
    TextPiece,
    ToolArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolFormat,
    TurnMarkers,
    callable_tools,
    choice_text,
    new_tool_use_id,
)
from ikcode.gateway.tool_formats.deepseek_v3 import DeepSeekV3Format
from ikcode.gateway.tool_formats.harmony import HarmonyFormat
from ikcode.gateway.tool_formats.hermes import HermesFormat
from ikcode.gateway.tool_formats.llama3_json import Llama3JsonFormat
from ikcode.gateway.tool_formats.mistral import MistralFormat
from ikcode.gateway.tool_formats.qwen3_coder import Qwen3CoderFormat

FORMATS: dict[str, type[ToolFormat]] = {
    cls.name: cls
    for cls in (
        HermesFormat,
        Qwen3CoderFormat,
        Llama3JsonFormat,
        MistralFormat,
        DeepSeekV3Format,
        HarmonyFormat,
    )
}
# (format, markers that must all be in the template), most specific first: Qwen3-Coder's template
# also has <tool_call>, and Llama 3.x templates without tool support still have the header tokens.
_DETECTION: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mistral", ("[TOOL_CALLS]",)),
    ("deepseek_v3", ("tool▁call▁begin",)),
    ("harmony", ("<|channel|>", "<|message|>")),
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|start_header_id|>",)),
)


class UnknownToolFormat(ValueError):
    pass


def detect_tool_format(chat_template: str | None) -> str:
    for name, markers in _DETECTION:
        if chat_template and all(marker in chat_template for marker in markers):
            return name
    return HermesFormat.name


def tool_format_for(chat_template: str | None, override: str = "") -> ToolFormat:
    """The format a profile names, else the one the chat template shows."""
    name = override or detect_tool_format(chat_template)
    if name not in FORMATS:
        raise UnknownToolFormat(f"unknown tool_format {name!r}; known: {', '.join(sorted(FORMATS))}")
    return FORMATS[name]()


__all__ = [
    "FORMATS", "CallItem", "HermesFormat", "ParseEvent", "ResultItem", "StreamParser", "TextOnlyParser",
    "TextPiece", "ToolArgsDelta", "ToolCallEnd", "ToolCallStart", "ToolFormat", "TurnMarkers",
    "UnknownToolFormat",
    "callable_tools", "choice_text", "detect_tool_format", "new_tool_use_id", "tool_format_for",
]  # fmt: skip
