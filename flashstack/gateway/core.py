"""Canonical request, response and stream-event types.

Providers speak only these types; wire formats (OpenAI, Anthropic) are translated at the edges,
so N wire formats + M providers need N + M adapters.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias


class StopReason(enum.StrEnum):
    """Why generation stopped, in canonical (Anthropic-flavoured) terms; mapped at the edges."""

    END_TURN = "end_turn"
    MAX_TOKENS = "max_tokens"
    STOP_SEQUENCE = "stop_sequence"
    TOOL_USE = "tool_use"
    REFUSAL = "refusal"
    PAUSE_TURN = "pause_turn"
    CONTEXT_WINDOW_EXCEEDED = "model_context_window_exceeded"


# ---- message parts -------------------------------------------------------------------------


@dataclass(slots=True)
class Text:
    text: str


@dataclass(slots=True)
class Image:
    """An image by value (base64 `data`, with its media type) or by reference (`url`)."""

    media_type: str | None = None
    data: str | None = None  # base64, without a data: prefix
    url: str | None = None


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, exactly as the model produced it


@dataclass(slots=True)
class ToolResult:
    tool_call_id: str
    content: list[Text | Image]
    is_error: bool = False


@dataclass(slots=True)
class Thinking:
    text: str
    signature: str | None = None


Part: TypeAlias = Text | Image | ToolCall | ToolResult | Thinking
Role: TypeAlias = Literal["user", "assistant"]


@dataclass(slots=True)
class Message:
    """One turn. Tool results travel as parts of a user message, as in Anthropic's Messages API."""

    role: Role
    parts: list[Part]


@dataclass(slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # JSON Schema of the arguments


@dataclass(slots=True)
class ToolChoice:
    mode: Literal["auto", "none", "any", "tool"] = "auto"
    name: str | None = None  # set when mode == "tool"
    disable_parallel: bool = False


@dataclass(slots=True)
class ResponseFormat:
    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool = False


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[Message]
    system: list[Text] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    include_usage: bool = False  # OpenAI stream_options.include_usage
    metadata: dict[str, Any] = field(default_factory=dict)
    # Extension fields a client may send (e.g. "compression"); providers ignore what they don't know.
    extensions: dict[str, Any] = field(default_factory=dict)

    def system_text(self) -> str:
        return "\n\n".join(t.text for t in self.system)


@dataclass(slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


@dataclass(slots=True)
class ChatResponse:
    id: str
    model: str
    content: list[Part]
    stop_reason: StopReason
    usage: Usage
    stop_sequence: str | None = None
    created: int = 0

    def text(self) -> str:
        return "".join(p.text for p in self.content if isinstance(p, Text))


# ---- stream events -------------------------------------------------------------------------
# Block indexes follow Anthropic's content_block index: each text, tool-call or thinking block has
# its own index, and its deltas carry it. A block begins with its first delta (text, thinking) or
# with ToolCallStart, and ends with BlockStop.


@dataclass(slots=True)
class Start:
    id: str
    model: str
    usage: Usage = field(default_factory=Usage)  # input tokens, when known up front


@dataclass(slots=True)
class TextDelta:
    index: int
    text: str


@dataclass(slots=True)
class ThinkingDelta:
    index: int
    text: str
    signature: str | None = None


@dataclass(slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(slots=True)
class ToolArgsDelta:
    index: int
    fragment: str


@dataclass(slots=True)
class BlockStop:
    index: int


@dataclass(slots=True)
class Finish:
    stop_reason: StopReason
    usage: Usage  # totals for the whole response, never increments
    stop_sequence: str | None = None


@dataclass(slots=True)
class Error:
    """A failure after the stream began; rendered as the caller's stream-error format."""

    error: "GatewayError"


Event: TypeAlias = (
    Start | TextDelta | ThinkingDelta | ToolCallStart | ToolArgsDelta | BlockStop | Finish | Error
)


# ---- errors --------------------------------------------------------------------------------


class ErrorKind(enum.StrEnum):
    """Canonical error classes; each wire format renders its own type names and status codes."""

    INVALID_REQUEST = "invalid_request"
    AUTHENTICATION = "authentication"
    PERMISSION = "permission"
    NOT_FOUND = "not_found"
    REQUEST_TOO_LARGE = "request_too_large"
    RATE_LIMIT = "rate_limit"
    TIMEOUT = "timeout"
    UPSTREAM = "upstream"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"


_STATUS = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.AUTHENTICATION: 401,
    ErrorKind.PERMISSION: 403,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.REQUEST_TOO_LARGE: 413,
    ErrorKind.RATE_LIMIT: 429,
    ErrorKind.TIMEOUT: 504,
    ErrorKind.UPSTREAM: 502,
    ErrorKind.OVERLOADED: 529,
    ErrorKind.INTERNAL: 500,
}


class GatewayError(Exception):
    """An error with enough structure for every wire format to render it faithfully."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        status: int | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status if status is not None else _STATUS[kind]
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        """True for failures another attempt or deployment may not hit (never for 4xx-by-caller)."""
        return self.status in (408, 429) or self.status >= 500

    def __repr__(self) -> str:
        return f"GatewayError({self.kind.value}, {self.status}, {self.message!r})"


def invalid_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(ErrorKind.INVALID_REQUEST, message, param=param)


def error_for_status(status: int, message: str, retry_after: float | None = None) -> GatewayError:
    """The canonical error for an upstream HTTP status."""
    kind = {
        400: ErrorKind.INVALID_REQUEST,
        401: ErrorKind.AUTHENTICATION,
        403: ErrorKind.PERMISSION,
        404: ErrorKind.NOT_FOUND,
        408: ErrorKind.TIMEOUT,
        413: ErrorKind.REQUEST_TOO_LARGE,
        422: ErrorKind.INVALID_REQUEST,
        429: ErrorKind.RATE_LIMIT,
        503: ErrorKind.OVERLOADED,
        504: ErrorKind.TIMEOUT,
        529: ErrorKind.OVERLOADED,
    }.get(status, ErrorKind.UPSTREAM if status >= 500 else ErrorKind.INVALID_REQUEST)
    return GatewayError(kind, message, status=status, retry_after=retry_after)
