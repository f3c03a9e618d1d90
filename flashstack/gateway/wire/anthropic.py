"""Anthropic Messages request types, field for field as the official SDK names them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


class _Wire(BaseModel):
    # Unknown fields are kept, not rejected: clients send newer fields than we know of.
    model_config = ConfigDict(extra="allow")


class Base64Source(_Wire):
    type: Literal["base64"]
    media_type: str
    data: str


class URLSource(_Wire):
    type: Literal["url"]
    url: str


class OtherSource(_Wire):
    type: str  # "file" (Files API) and future kinds: the block passes on the same wire only


def _tag(known: tuple[str, ...]) -> Any:
    def tag(v: Any) -> str:
        t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
        return t if t in known else "other"

    return Discriminator(tag)


ImageSource = Annotated[
    Annotated[Base64Source, Tag("base64")]
    | Annotated[URLSource, Tag("url")]
    | Annotated[OtherSource, Tag("other")],
    _tag(("base64", "url")),
]


class TextBlock(_Wire):
    type: Literal["text"]
    text: str


class ImageBlock(_Wire):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Wire):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class OtherBlock(_Wire):
    """A block type this gateway does not model (document, search_result, server tools' blocks, a
    future one): kept verbatim."""

    type: str


ResultBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[OtherBlock, Tag("other")],
    _tag(("text", "image")),
]


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Wire):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Wire):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]
    | Annotated[OtherBlock, Tag("other")],
    _tag(("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")),
]


class MessageParam(_Wire):
    # system: an instruction mid-conversation (Claude Code sends one)
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolDef(_Wire):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # absent on server tools ({"type": "web_search_…"})
    type: str | None = None


class ToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Wire):
    user_id: str | None = None


class MessagesRequest(_Wire):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
