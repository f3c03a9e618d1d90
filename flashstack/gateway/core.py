"""Canonical request, response and stream-event types.

Providers speak only these types; wire formats (OpenAI, Anthropic) are translated at the edges,
so N wire formats + M providers need N + M adapters.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

# Wire fields a canonical object does not model, under the client's own names and values (JSON).
# They travel untouched to an upstream that speaks the client's wire (`ChatRequest.wire`); another
# wire never sees them (translate/fields.py says, field by field, what happens there instead).
Extra: TypeAlias = dict[str, Any]


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


# `cache_control` is Anthropic's prompt-caching marker ({"type": "ephemeral", "ttl"?}), kept as
# sent; an upstream without prompt caching drops it and names it in x-flashstack-dropped.


@dataclass(slots=True)
class Text:
    text: str
    cache_control: dict[str, Any] | None = None
    extra: Extra = field(default_factory=dict)  # e.g. Anthropic citations


@dataclass(slots=True)
class Image:
    """An image by value (base64 `data`, with its media type) or by reference (`url`)."""

    media_type: str | None = None
    data: str | None = None  # base64, without a data: prefix
    url: str | None = None
    cache_control: dict[str, Any] | None = None
    extra: Extra = field(default_factory=dict)  # e.g. OpenAI {"image_url": {"detail": "low"}}


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, exactly as the model produced it
    cache_control: dict[str, Any] | None = None
    extra: Extra = field(default_factory=dict)


@dataclass(slots=True)
class ToolResult:
    tool_call_id: str
    content: list[Text | Image]
    is_error: bool = False
    cache_control: dict[str, Any] | None = None
    extra: Extra = field(default_factory=dict)
    # The content arrived as one bare string (so it goes back as one): the default, as a string is
    # what every server takes for what the gateway makes itself (a session's history).
    plain: bool = True


@dataclass(slots=True)
class Thinking:
    """Reasoning the model showed; `signature` (Anthropic) must come back unchanged
    in later turns."""

    text: str
    signature: str | None = None
    extra: Extra = field(default_factory=dict)


@dataclass(slots=True)
class RedactedThinking:
    """Anthropic's encrypted reasoning: opaque, only its own API can read it back."""

    data: str


@dataclass(slots=True)
class Opaque:
    """A content block the canonical types do not model (a PDF document, a server tool's result, a
    future type), verbatim in the wire it came from: passed to that wire, refused by another."""

    wire: str
    block: dict[str, Any]

    @property
    def type(self) -> str:
        return str(self.block.get("type", "?"))


Part: TypeAlias = Text | Image | ToolCall | ToolResult | Thinking | RedactedThinking | Opaque
# "system": an instruction in the middle of the conversation (Anthropic's messages may carry one).
Role: TypeAlias = Literal["user", "assistant", "system"]


@dataclass(slots=True)
class Message:
    """One turn. Tool results travel as parts of a user message, as in Anthropic's Messages API."""

    role: Role
    parts: list[Part]
    extra: Extra = field(default_factory=dict)  # e.g. OpenAI `name`
    plain: bool = True  # the content arrived as one bare string (as ToolResult.plain says)
    # The wire its extras are in, for a message from a session's history (None: the request's own).
    wire: str | None = None


@dataclass(slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # JSON Schema of the arguments
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None
    extra: Extra = field(default_factory=dict)  # e.g. Anthropic defer_loading


@dataclass(slots=True)
class Reasoning:
    """How much the model may think: Anthropic's thinking budget or OpenAI's reasoning effort."""

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    budget_tokens: int | None = None


@dataclass(slots=True)
class Exchange:
    """What one request learned on its way through a provider, for the client's response headers.

    Shared by every copy of the request (dataclasses.replace keeps the reference).
    """

    dropped: set[str] = field(default_factory=set)  # fields the chosen upstream could not take
    headers: dict[str, str] = field(default_factory=dict)  # upstream response headers clients read


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
    # The gateway's own request fields (e.g. "compression"); never sent upstream.
    extensions: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    reasoning: Reasoning | None = None
    # The wire the client spoke ("openai" | "anthropic"; None: built inside the gateway), and its
    # top-level fields the gateway never rewrites, verbatim: an upstream of that wire gets them as
    # sent, the typed fields above are what another wire gets.
    wire: str | None = None
    extra: Extra = field(default_factory=dict)
    system_plain: bool = False  # Anthropic `system` arrived as a string, not blocks
    # Client headers on the provider's allow-list (anthropic-beta, openai-organization, …).
    headers: dict[str, str] = field(default_factory=dict)
    exchange: Exchange = field(default_factory=Exchange)

    def system_text(self) -> str:
        return "\n\n".join(t.text for t in self.system)


@dataclass(slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    reasoning_tokens: int = 0
    # Set when the gateway counted these itself (the upstream reported none): the counter's name,
    # which a client reads in the usage object's ESTIMATE_FIELD.
    estimated: str | None = None


ESTIMATE_FIELD = "flashstack_estimate"


@dataclass(slots=True)
class Raw:
    """An upstream's own response body or stream events, for a client of the same wire.

    A client that speaks `wire` gets exactly these (`model` renamed to the one it asked for): every
    field the upstream returned, including those no canonical type models.
    """

    wire: str
    items: list[tuple[str, dict[str, Any]]]  # (SSE event name, "" for none; the JSON), as received


@dataclass(slots=True)
class ChatResponse:
    id: str
    model: str
    content: list[Part]
    stop_reason: StopReason
    usage: Usage
    stop_sequence: str | None = None
    created: int = 0
    raw: Raw | None = None
    # The reply message's own keys no field above models, in `raw`'s wire (OpenAI's refusal,
    # annotations, audio, …): set where a session stores a same-wire reply whole, to send it back.
    extra: Extra = field(default_factory=dict)

    def text(self) -> str:
        return "".join(p.text for p in self.content if isinstance(p, Text))


# ---- stream events -------------------------------------------------------------------------
# Block indexes follow Anthropic's content_block index: each text, tool-call or thinking block has
# its own index, and its deltas carry it. A block begins with its first delta (text, thinking) or
# with ToolCallStart, and ends with BlockStop.
#
# `raw`: the upstream events an event was decoded from (with those before it that decoded to
# nothing: a ping, a usage chunk), for an encoder of the same wire, which sends them as they came.
# Events decoded from one upstream event after the first carry SAME_RAW (sent already). Events the
# gateway makes itself carry None, and are rendered.


@dataclass(slots=True)
class Start:
    id: str
    model: str
    usage: Usage = field(default_factory=Usage)  # input tokens, when known up front
    raw: Raw | None = None


@dataclass(slots=True)
class TextDelta:
    index: int
    text: str
    raw: Raw | None = None


@dataclass(slots=True)
class ThinkingDelta:
    index: int
    text: str
    signature: str | None = None
    raw: Raw | None = None


@dataclass(slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str
    raw: Raw | None = None


@dataclass(slots=True)
class ToolArgsDelta:
    index: int
    fragment: str
    raw: Raw | None = None


@dataclass(slots=True)
class BlockStop:
    index: int
    raw: Raw | None = None


@dataclass(slots=True)
class Finish:
    stop_reason: StopReason
    usage: Usage  # totals for the whole response, never increments
    stop_sequence: str | None = None
    raw: Raw | None = None


@dataclass(slots=True)
class Error:
    """A failure after the stream began; rendered as the caller's stream-error format."""

    error: "GatewayError"


Event: TypeAlias = (
    Start | TextDelta | ThinkingDelta | ToolCallStart | ToolArgsDelta | BlockStop | Finish | Error
)
SAME_RAW = Raw("", [])  # see the note above Start


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
