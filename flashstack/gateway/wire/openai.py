"""OpenAI's wire: chat-completions request types, field for field as the official SDK names them,
and the framing every OpenAI front end writes (SSE events, error and usage bodies). The gateway and
the engine's server (flashstack.engine.server) both speak through this module."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from flashstack.gateway.core import ErrorKind, GatewayError

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(body: Any) -> bytes:
    """One server-sent event carrying `body` as JSON, as OpenAI streams chunks."""
    return b"data: " + orjson.dumps(body) + b"\n\n"


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error object, `{"error": {...}}`, with all four keys the SDK reads."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ERROR_TYPE = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.AUTHENTICATION: "authentication_error",
    ErrorKind.PERMISSION: "permission_error",
    ErrorKind.NOT_FOUND: "invalid_request_error",  # what OpenAI sends with code model_not_found
    ErrorKind.REQUEST_TOO_LARGE: "invalid_request_error",
    ErrorKind.RATE_LIMIT: "rate_limit_error",
    ErrorKind.TIMEOUT: "timeout_error",
    ErrorKind.UPSTREAM: "api_error",
    ErrorKind.OVERLOADED: "server_error",
    ErrorKind.INTERNAL: "server_error",
}


def error_json(err: GatewayError) -> dict[str, Any]:
    """OpenAI's error object for a canonical error."""
    # code: model_not_found only where a model is unknown (router, /v1/models/{id})
    return error_body(err.message, ERROR_TYPE[err.kind], err.param, err.code)


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's `usage` object from the two counts."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class _Wire(BaseModel):
    # Unknown fields are kept, not rejected: clients send newer fields than we know of.
    model_config = ConfigDict(extra="allow")


class TextPart(_Wire):
    type: Literal["text"]
    text: str


class ImageURL(_Wire):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Wire):
    type: Literal["image_url"]
    image_url: ImageURL


class RefusalPart(_Wire):
    type: Literal["refusal"]
    refusal: str


class OtherPart(_Wire):
    """A part type this gateway does not model (input_audio, file, a future one): kept verbatim."""

    type: str


def _part_tag(v: Any) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return t if t in ("text", "image_url", "refusal") else "other"


ContentPart = Annotated[
    Annotated[TextPart, Tag("text")]
    | Annotated[ImagePart, Tag("image_url")]
    | Annotated[RefusalPart, Tag("refusal")]
    | Annotated[OtherPart, Tag("other")],
    Discriminator(_part_tag),
]


class FunctionCall(_Wire):
    name: str
    arguments: str


class ToolCallWire(_Wire):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Wire):
    role: Literal["system", "developer"]
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(_Wire):
    role: Literal["user"]
    content: str | list[ContentPart]
    name: str | None = None


class AssistantMessage(_Wire):
    role: Literal["assistant"]
    content: str | list[TextPart | RefusalPart] | None = None
    tool_calls: list[ToolCallWire] | None = None
    refusal: str | None = None
    name: str | None = None


class ToolMessage(_Wire):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionDef(_Wire):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Wire):
    type: str = "function"  # "custom" tools (free-text input) pass on the same wire only
    function: FunctionDef | None = None


class NamedFunction(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"] = "function"
    function: NamedFunction


class JSONSchemaSpec(_Wire):
    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


class StreamOptions(_Wire):
    include_usage: bool | None = None


class ChatCompletionRequest(_Wire):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: int | None = Field(default=None, ge=1, le=128)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, float] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
