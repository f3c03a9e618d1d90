"""Anthropic Messages ⇄ canonical types, for clients (inbound) and upstreams (outbound)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import orjson

from flashstack.gateway.core import (
    BlockStop,
    ChatRequest,
    ChatResponse,
    Error,
    ErrorKind,
    Event,
    Finish,
    GatewayError,
    Image,
    Message,
    Part,
    ResponseFormat,
    Start,
    StopReason,
    Text,
    TextDelta,
    Thinking,
    ThinkingDelta,
    Tool,
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
    ToolChoice,
    ToolResult,
    Usage,
    error_for_status,
    invalid_request,
)
from flashstack.gateway.vision import checked_base64_image
from flashstack.gateway.wire import anthropic as w

ERROR_TYPE = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.AUTHENTICATION: "authentication_error",
    ErrorKind.PERMISSION: "permission_error",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.REQUEST_TOO_LARGE: "request_too_large",
    ErrorKind.RATE_LIMIT: "rate_limit_error",
    ErrorKind.TIMEOUT: "timeout_error",
    ErrorKind.UPSTREAM: "api_error",
    ErrorKind.OVERLOADED: "overloaded_error",
    ErrorKind.INTERNAL: "api_error",
}
_ERROR_KIND = {
    "invalid_request_error": ErrorKind.INVALID_REQUEST,
    "authentication_error": ErrorKind.AUTHENTICATION,
    "permission_error": ErrorKind.PERMISSION,
    "not_found_error": ErrorKind.NOT_FOUND,
    "request_too_large": ErrorKind.REQUEST_TOO_LARGE,
    "rate_limit_error": ErrorKind.RATE_LIMIT,
    "timeout_error": ErrorKind.TIMEOUT,
    "api_error": ErrorKind.UPSTREAM,
    "overloaded_error": ErrorKind.OVERLOADED,
}
_KIND_STATUS = {
    ErrorKind.OVERLOADED: 529,
    ErrorKind.UPSTREAM: 500,
}
DEFAULT_MAX_TOKENS = 4096  # Anthropic requires max_tokens; OpenAI clients may omit it


# ---- client → canonical ----------------------------------------------------------------------


def to_canonical(req: w.MessagesRequest) -> ChatRequest:
    """The canonical request for an Anthropic Messages request."""
    messages = [
        Message(m.role, _parts(m.content, f"messages[{i}].content")) for i, m in enumerate(req.messages)
    ]
    if isinstance(req.system, str):
        system = [Text(req.system)] if req.system else []
    else:
        system = [Text(b.text) for b in req.system or []]
    metadata: dict[str, Any] = {}
    if req.metadata is not None:
        metadata = req.metadata.model_dump(exclude_none=True)
    return ChatRequest(
        model=req.model,
        messages=messages,
        system=system,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=list(req.stop_sequences or []),
        tools=[Tool(t.name, t.description, t.input_schema) for t in req.tools or []],
        tool_choice=_tool_choice(req.tool_choice),
        stream=bool(req.stream),
        metadata=metadata,
        extensions=dict(req.model_extra or {}),
    )


def _parts(content: str | list[Any], param: str) -> list[Part]:
    if isinstance(content, str):
        return [Text(content)]
    parts: list[Part] = []
    for j, b in enumerate(content):
        p = f"{param}[{j}]"
        if isinstance(b, w.TextBlock):
            parts.append(Text(b.text))
        elif isinstance(b, w.ImageBlock):
            parts.append(_image(b, p))
        elif isinstance(b, w.ToolUseBlock):
            parts.append(ToolCall(b.id, b.name, orjson.dumps(b.input).decode()))
        elif isinstance(b, w.ToolResultBlock):
            parts.append(_tool_result(b, p))
        elif isinstance(b, w.ThinkingBlock):
            parts.append(Thinking(b.thinking, b.signature))
        # redacted_thinking carries nothing another provider can use; it is dropped.
    return parts


def _image(b: w.ImageBlock, param: str) -> Image:
    if isinstance(b.source, w.Base64Source):
        return checked_base64_image(b.source.media_type, b.source.data, f"{param}.source")
    return Image(url=b.source.url)


def _tool_result(b: w.ToolResultBlock, param: str) -> ToolResult:
    if b.content is None:
        content: list[Text | Image] = []
    elif isinstance(b.content, str):
        content = [Text(b.content)]
    else:
        content = [
            Text(c.text) if isinstance(c, w.TextBlock) else _image(c, f"{param}.content")
            for c in b.content
        ]
    return ToolResult(b.tool_use_id, content, bool(b.is_error))


def _tool_choice(tc: w.ToolChoice | None) -> ToolChoice | None:
    if tc is None:
        return None
    if tc.type == "tool" and not tc.name:
        raise invalid_request("tool_choice of type 'tool' needs a name", "tool_choice.name")
    return ToolChoice(tc.type, tc.name, bool(tc.disable_parallel_tool_use))


# ---- canonical → client ----------------------------------------------------------------------


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def usage_json(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "cache_creation_input_tokens": u.cache_creation_input_tokens,
        "cache_read_input_tokens": u.cache_read_input_tokens,
    }


def _block_json(p: Part) -> dict[str, Any]:
    if isinstance(p, Text):
        return {"type": "text", "text": p.text}
    if isinstance(p, Thinking):
        return {"type": "thinking", "thinking": p.text, "signature": p.signature or ""}
    if isinstance(p, ToolCall):
        return {"type": "tool_use", "id": p.id, "name": p.name, "input": _tool_input(p)}
    raise TypeError(f"{type(p).__name__} cannot appear in an assistant message")


def _tool_input(p: ToolCall) -> dict[str, Any]:
    try:
        value = orjson.loads(p.arguments or "{}")
    except orjson.JSONDecodeError:
        raise GatewayError(
            ErrorKind.UPSTREAM, f"tool call {p.name!r} came back with arguments that are not JSON"
        ) from None
    return value if isinstance(value, dict) else {"value": value}


def response_json(resp: ChatResponse, model: str) -> dict[str, Any]:
    """An Anthropic Message body for a canonical response."""
    return {
        "id": resp.id if resp.id.startswith("msg_") else message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [_block_json(p) for p in resp.content],
        "stop_reason": resp.stop_reason.value,
        "stop_sequence": resp.stop_sequence,
        "usage": usage_json(resp.usage),
    }


def error_json(err: GatewayError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPE[err.kind], "message": err.message}}


class StreamEncoder:
    """Renders canonical events as the Messages API's SSE event sequence."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = message_id()
        self._index: dict[int, int] = {}  # canonical block index → wire index (dense, in order)
        self._open: set[int] = set()
        self._input_tokens = 0

    def encode(self, ev: Event) -> Iterator[bytes]:
        if isinstance(ev, Start):
            self._input_tokens = ev.usage.input_tokens
            usage = {"input_tokens": ev.usage.input_tokens, "output_tokens": 0}
            message = {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage,
            }
            yield _event("message_start", {"type": "message_start", "message": message})
            yield PING
        elif isinstance(ev, TextDelta):
            yield from self._begin(ev.index, {"type": "text", "text": ""})
            yield self._delta(ev.index, {"type": "text_delta", "text": ev.text})
        elif isinstance(ev, ThinkingDelta):
            yield from self._begin(ev.index, {"type": "thinking", "thinking": "", "signature": ""})
            if ev.text:
                yield self._delta(ev.index, {"type": "thinking_delta", "thinking": ev.text})
            if ev.signature:
                yield self._delta(ev.index, {"type": "signature_delta", "signature": ev.signature})
        elif isinstance(ev, ToolCallStart):
            block = {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}}
            yield from self._begin(ev.index, block)
        elif isinstance(ev, ToolArgsDelta):
            yield self._delta(ev.index, {"type": "input_json_delta", "partial_json": ev.fragment})
        elif isinstance(ev, BlockStop):
            yield from self._stop(ev.index)
        elif isinstance(ev, Finish):
            yield from self._finish(ev)
        elif isinstance(ev, Error):
            yield _event("error", error_json(ev.error))

    def _begin(self, index: int, block: dict[str, Any]) -> Iterator[bytes]:
        if index in self._index:
            return
        wire = self._index[index] = len(self._index)
        self._open.add(index)
        body = {"type": "content_block_start", "index": wire, "content_block": block}
        yield _event("content_block_start", body)

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        body = {"type": "content_block_delta", "index": self._index[index], "delta": delta}
        return _event("content_block_delta", body)

    def _stop(self, index: int) -> Iterator[bytes]:
        if index in self._open:
            self._open.discard(index)
            body = {"type": "content_block_stop", "index": self._index[index]}
            yield _event("content_block_stop", body)

    def _finish(self, ev: Finish) -> Iterator[bytes]:
        for index in sorted(self._open):
            yield from self._stop(index)
        usage = usage_json(ev.usage)
        usage["input_tokens"] = ev.usage.input_tokens or self._input_tokens
        delta = {"stop_reason": ev.stop_reason.value, "stop_sequence": ev.stop_sequence}
        yield _event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        yield _event("message_stop", {"type": "message_stop"})


def _event(name: str, body: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"


PING = _event("ping", {"type": "ping"})


# ---- canonical → upstream --------------------------------------------------------------------


def request_json(req: ChatRequest, upstream_model: str, default_max_tokens: int | None = None) -> dict[str, Any]:
    """The body the Messages API takes for a canonical request."""
    body: dict[str, Any] = {
        "model": upstream_model,
        "max_tokens": req.max_tokens or default_max_tokens or DEFAULT_MAX_TOKENS,
        "messages": _messages_json(req.messages),
    }
    system = req.system_text()
    if req.response_format is not None:
        system = (system + "\n\n" if system else "") + _json_instruction(req.response_format)
    if system:
        body["system"] = system
    if req.stop:
        body["stop_sequences"] = req.stop
    if req.temperature is not None:
        body["temperature"] = min(req.temperature, 1.0)  # OpenAI's range is 0–2, Anthropic's 0–1
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.top_k is not None:
        body["top_k"] = req.top_k
    if req.tools:
        body["tools"] = [
            {"name": t.name, "description": t.description or "", "input_schema": t.parameters} for t in req.tools
        ]
        if req.tool_choice is not None:
            body["tool_choice"] = _tool_choice_json(req.tool_choice)
    if req.metadata.get("user_id"):
        body["metadata"] = {"user_id": req.metadata["user_id"]}
    if req.stream:
        body["stream"] = True
    return body


def _json_instruction(rf: ResponseFormat) -> str:
    if rf.type == "json_schema" and rf.schema is not None:
        schema = orjson.dumps(rf.schema).decode()
        return f"Reply with one JSON value that conforms to this JSON Schema, and nothing else: {schema}"
    return "Reply with one JSON object and nothing else."


def _tool_choice_json(tc: ToolChoice) -> dict[str, Any]:
    body: dict[str, Any] = {"type": tc.mode}
    if tc.mode == "tool":
        body["name"] = tc.name
    if tc.disable_parallel and tc.mode != "none":
        body["disable_parallel_tool_use"] = True
    return body


def _messages_json(messages: list[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        blocks = [b for b in (_part_json(p) for p in m.parts) if b is not None]
        if m.role == "user":
            # The API wants tool results first in a user turn.
            blocks.sort(key=lambda b: b["type"] != "tool_result")
        if out and out[-1]["role"] == m.role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": m.role, "content": blocks})
    return out


def _part_json(p: Part) -> dict[str, Any] | None:
    if isinstance(p, Text):
        return {"type": "text", "text": p.text} if p.text else None
    if isinstance(p, Image):
        return _image_json(p)
    if isinstance(p, ToolCall):
        return {"type": "tool_use", "id": p.id, "name": p.name, "input": _tool_input_or_400(p)}
    if isinstance(p, ToolResult):
        content = [_image_json(c) if isinstance(c, Image) else {"type": "text", "text": c.text} for c in p.content]
        return {"type": "tool_result", "tool_use_id": p.tool_call_id, "content": content, "is_error": p.is_error}
    if isinstance(p, Thinking) and p.signature:
        return {"type": "thinking", "thinking": p.text, "signature": p.signature}
    return None


def _tool_input_or_400(p: ToolCall) -> dict[str, Any]:
    try:
        value = orjson.loads(p.arguments or "{}")
    except orjson.JSONDecodeError:
        raise invalid_request(f"arguments of tool call {p.id!r} are not valid JSON", "messages") from None
    return value if isinstance(value, dict) else {"value": value}


def _image_json(p: Image) -> dict[str, Any]:
    if p.data is not None:
        return {"type": "image", "source": {"type": "base64", "media_type": p.media_type, "data": p.data}}
    return {"type": "image", "source": {"type": "url", "url": p.url}}


# ---- upstream → canonical --------------------------------------------------------------------


def usage_from_json(u: dict[str, Any] | None) -> Usage:
    u = u or {}
    return Usage(
        u.get("input_tokens") or 0,
        u.get("output_tokens") or 0,
        u.get("cache_read_input_tokens") or 0,
        u.get("cache_creation_input_tokens") or 0,
    )


def _stop_reason(value: str | None) -> StopReason:
    try:
        return StopReason(value or "end_turn")
    except ValueError:
        return StopReason.END_TURN


def response_from_json(body: dict[str, Any]) -> ChatResponse:
    """The canonical response for a Messages API response body."""
    content: list[Part] = []
    for b in body.get("content") or []:
        kind = b.get("type")
        if kind == "text":
            content.append(Text(b.get("text", "")))
        elif kind == "tool_use":
            content.append(ToolCall(b["id"], b["name"], orjson.dumps(b.get("input") or {}).decode()))
        elif kind == "thinking":
            content.append(Thinking(b.get("thinking", ""), b.get("signature")))
    return ChatResponse(
        id=body.get("id") or message_id(),
        model=body.get("model", ""),
        content=content,
        stop_reason=_stop_reason(body.get("stop_reason")),
        usage=usage_from_json(body.get("usage")),
        stop_sequence=body.get("stop_sequence"),
    )


def upstream_error(status: int, body: Any, retry_after: float | None = None) -> GatewayError:
    """The canonical error for a Messages API error body."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        kind = _ERROR_KIND.get(err.get("type", ""))
        message = str(err.get("message") or err)
        if kind is not None:
            return GatewayError(kind, message, status=status, retry_after=retry_after)
        return error_for_status(status, message, retry_after)
    return error_for_status(status, str(body)[:500] or f"upstream returned HTTP {status}", retry_after)


class EventDecoder:
    """Turns Messages API stream events into canonical events."""

    def __init__(self) -> None:
        self.usage = Usage()
        self.stop_reason: StopReason = StopReason.END_TURN
        self.stop_sequence: str | None = None

    def feed(self, name: str, data: dict[str, Any]) -> Iterator[Event]:
        kind = data.get("type", name)
        if kind == "message_start":
            msg = data.get("message") or {}
            self.usage = usage_from_json(msg.get("usage"))
            yield Start(msg.get("id") or message_id(), msg.get("model", ""), Usage(self.usage.input_tokens))
        elif kind == "content_block_start":
            yield from self._block_start(data["index"], data.get("content_block") or {})
        elif kind == "content_block_delta":
            yield from self._block_delta(data["index"], data.get("delta") or {})
        elif kind == "content_block_stop":
            yield BlockStop(data["index"])
        elif kind == "message_delta":
            self._message_delta(data)
        elif kind == "message_stop":
            yield Finish(self.stop_reason, self.usage, self.stop_sequence)
        elif kind == "error":
            status = _KIND_STATUS.get(_ERROR_KIND.get((data.get("error") or {}).get("type", ""), ErrorKind.UPSTREAM), 500)
            raise upstream_error(status, data)

    def _block_start(self, index: int, block: dict[str, Any]) -> Iterator[Event]:
        kind = block.get("type")
        if kind == "tool_use":
            yield ToolCallStart(index, block.get("id", ""), block.get("name", ""))
            if block.get("input"):
                yield ToolArgsDelta(index, orjson.dumps(block["input"]).decode())
        elif kind == "text" and block.get("text"):
            yield TextDelta(index, block["text"])
        elif kind == "thinking" and block.get("thinking"):
            yield ThinkingDelta(index, block["thinking"])

    def _block_delta(self, index: int, delta: dict[str, Any]) -> Iterator[Event]:
        kind = delta.get("type")
        if kind == "text_delta":
            yield TextDelta(index, delta.get("text", ""))
        elif kind == "input_json_delta":
            if delta.get("partial_json"):
                yield ToolArgsDelta(index, delta["partial_json"])
        elif kind == "thinking_delta":
            yield ThinkingDelta(index, delta.get("thinking", ""))
        elif kind == "signature_delta":
            yield ThinkingDelta(index, "", delta.get("signature"))

    def _message_delta(self, data: dict[str, Any]) -> None:
        delta = data.get("delta") or {}
        if delta.get("stop_reason"):
            self.stop_reason = _stop_reason(delta["stop_reason"])
        self.stop_sequence = delta.get("stop_sequence") or self.stop_sequence
        # Usage in message_delta is cumulative: it replaces, never adds.
        u = data.get("usage") or {}
        if u.get("output_tokens") is not None:
            self.usage.output_tokens = u["output_tokens"]
        if u.get("input_tokens"):
            self.usage.input_tokens = u["input_tokens"]
        for name in ("cache_read_input_tokens", "cache_creation_input_tokens"):
            if u.get(name) is not None:
                setattr(self.usage, name, u[name])
