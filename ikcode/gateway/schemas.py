"""Wire models of the Anthropic Messages API: what clients send and what we answer.

Requests are open (extra="allow"): clients add fields and beta features faster than any server
can follow, and an unknown field must not turn into a 400. Content blocks are validated by their
`type`; block types we cannot serve (images at the top level, PDF documents) are refused later,
in rendering, with a message that says why.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------------------------------
# Content blocks (request side)
# ---------------------------------------------------------------------------------------------
class TextBlock(_Open):
    type: Literal["text"]
    text: StrictStr


class ImageBlock(_Open):
    type: Literal["image"]
    source: dict[str, Any] | None = None


class DocumentBlock(_Open):
    type: Literal["document"]
    source: dict[str, Any]
    title: StrictStr | None = None


class ToolUseBlock(_Open):
    type: Literal["tool_use", "server_tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]


class ToolReferenceBlock(_Open):
    """A deferred tool loaded by a tool search: its definition enters the prompt here."""

    type: Literal["tool_reference"]
    tool_name: StrictStr


class ToolResultBlock(_Open):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock | ImageBlock | DocumentBlock | ToolReferenceBlock] | None = None
    is_error: StrictBool | None = None


class ThinkingBlock(_Open):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(_Open):
    type: Literal["redacted_thinking"]
    data: StrictStr


ContentBlock = Annotated[
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Open):
    # "system" mid-conversation is what Claude Code sends with mid-conversation-system.
    role: Literal["user", "assistant", "system"]
    content: StrictStr | list[ContentBlock]


class SystemText(_Open):
    type: Literal["text"]
    text: StrictStr


class Tool(_Open):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    input_schema: dict[str, Any] | None = None
    type: StrictStr | None = None  # server tools ("web_search_20250305", ...) carry a type
    # A deferred tool stays out of the prompt until a tool_reference block loads it.
    defer_loading: StrictBool | None = None


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(_Open):
    type: StrictStr
    budget_tokens: StrictInt | None = None


class MessagesRequest(_Open):
    model: StrictStr
    messages: list[Message]
    max_tokens: StrictInt
    system: StrictStr | list[SystemText] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0, le=2**31 - 1)  # an engine's int32
    metadata: dict[str, Any] | None = None
    thinking: Thinking | None = None
    output_config: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    stream: StrictBool | None = None


class CountTokensRequest(_Open):
    model: StrictStr
    messages: list[Message]
    system: StrictStr | list[SystemText] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


class Usage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class OutText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class OutToolUse(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutText | OutToolUse]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail
