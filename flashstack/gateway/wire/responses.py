"""OpenAI Responses API request types (`POST /v1/responses`), named as the official SDK names them.

Input items and tools stay JSON here: translate/responses.py reads each by its `type`, so that a
type the gateway does not model is refused by name instead of failing a union's validation.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Wire(BaseModel):
    # Unknown fields are kept, not rejected: clients send newer fields than we know of.
    model_config = ConfigDict(extra="allow")


class TextFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Wire):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Wire):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # its deprecated name


class ResponsesRequest(_Wire):
    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    stream: bool | None = False
    user: str | None = None
