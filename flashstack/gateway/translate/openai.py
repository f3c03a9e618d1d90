"""OpenAI chat completions ⇄ canonical types, for clients (inbound) and upstreams (outbound)."""

from __future__ import annotations

import time
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
from flashstack.gateway.vision import image_from_url
from flashstack.gateway.wire import openai as w

FINISH_REASON = {
    StopReason.END_TURN: "stop",
    StopReason.STOP_SEQUENCE: "stop",
    StopReason.PAUSE_TURN: "stop",
    StopReason.MAX_TOKENS: "length",
    StopReason.CONTEXT_WINDOW_EXCEEDED: "length",
    StopReason.TOOL_USE: "tool_calls",
    StopReason.REFUSAL: "content_filter",
}
STOP_REASON = {
    "stop": StopReason.END_TURN,
    "length": StopReason.MAX_TOKENS,
    "tool_calls": StopReason.TOOL_USE,
    "function_call": StopReason.TOOL_USE,
    "content_filter": StopReason.REFUSAL,
}
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


# ---- client → canonical ----------------------------------------------------------------------


def to_canonical(req: w.ChatCompletionRequest) -> ChatRequest:
    """The canonical request for an OpenAI chat-completions request."""
    system: list[Text] = []
    messages: list[Message] = []
    for i, m in enumerate(req.messages):
        param = f"messages[{i}]"
        if isinstance(m, w.SystemMessage):
            system.append(Text(_text_of(m.content)))
        elif isinstance(m, w.UserMessage):
            _append(messages, "user", _user_parts(m.content, param))
        elif isinstance(m, w.AssistantMessage):
            _append(messages, "assistant", _assistant_parts(m))
        elif isinstance(m, w.ToolMessage):
            result = ToolResult(m.tool_call_id, [Text(_text_of(m.content))])
            _append(messages, "user", [result])
    if not messages:
        raise invalid_request("messages must contain at least one user or assistant message", "messages")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    extra = dict(req.model_extra or {})
    if req.seed is not None:
        extra["seed"] = req.seed
    metadata = dict(req.metadata or {})
    if req.user:
        metadata["user"] = req.user
    return ChatRequest(
        model=req.model,
        messages=messages,
        system=system,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=stop,
        tools=[_tool(t) for t in req.tools or []],
        tool_choice=_tool_choice(req.tool_choice, req.parallel_tool_calls),
        response_format=_response_format(req.response_format),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        metadata=metadata,
        extensions=extra,
    )


def _append(messages: list[Message], role: str, parts: list[Part]) -> None:
    # Consecutive same-role turns (e.g. several tool results) become one canonical message.
    if messages and messages[-1].role == role:
        messages[-1].parts.extend(parts)
    else:
        messages.append(Message(role, parts))  # type: ignore[arg-type]


def _text_of(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(getattr(p, "text", None) or getattr(p, "refusal", "") for p in content)


def _user_parts(content: str | list[Any], param: str) -> list[Part]:
    if isinstance(content, str):
        return [Text(content)]
    parts: list[Part] = []
    for j, p in enumerate(content):
        if isinstance(p, w.TextPart):
            parts.append(Text(p.text))
        elif isinstance(p, w.ImagePart):
            parts.append(image_from_url(p.image_url.url, f"{param}.content[{j}].image_url.url"))
        else:
            parts.append(Text(p.refusal))
    return parts


def _assistant_parts(m: w.AssistantMessage) -> list[Part]:
    parts: list[Part] = []
    if m.content:
        parts.append(Text(_text_of(m.content)))
    for tc in m.tool_calls or []:
        parts.append(ToolCall(tc.id, tc.function.name, tc.function.arguments or "{}"))
    return parts


def _tool(t: w.ToolDef) -> Tool:
    params = t.function.parameters or {"type": "object", "properties": {}}
    return Tool(t.function.name, t.function.description, params)


def _tool_choice(choice: Any, parallel: bool | None) -> ToolChoice | None:
    disable = parallel is False
    if choice is None:
        return ToolChoice("auto", disable_parallel=True) if disable else None
    if isinstance(choice, w.NamedToolChoice):
        return ToolChoice("tool", choice.function.name, disable)
    return ToolChoice({"none": "none", "auto": "auto", "required": "any"}[choice], None, disable)


def _response_format(rf: w.ResponseFormat | None) -> ResponseFormat | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return ResponseFormat("json_object")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise invalid_request("response_format json_schema needs json_schema.schema", "response_format")
    js = rf.json_schema
    return ResponseFormat("json_schema", js.schema_, js.name, bool(js.strict))


# ---- canonical → client ----------------------------------------------------------------------


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def usage_json(u: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
    }
    if u.cache_read_input_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": u.cache_read_input_tokens}
    return body


def response_json(resp: ChatResponse, model: str) -> dict[str, Any]:
    """An OpenAI ChatCompletion body for a canonical response."""
    text = "".join(p.text for p in resp.content if isinstance(p, Text))
    tool_calls = [_tool_call_json(p) for p in resp.content if isinstance(p, ToolCall)]
    message: dict[str, Any] = {"role": "assistant", "content": text or None, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    reasoning = "".join(p.text for p in resp.content if isinstance(p, Thinking))
    if reasoning:
        message["reasoning_content"] = reasoning
    return {
        "id": resp.id if resp.id.startswith("chatcmpl") else completion_id(),
        "object": "chat.completion",
        "created": resp.created or int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": FINISH_REASON[resp.stop_reason],
                "logprobs": None,
            }
        ],
        "usage": usage_json(resp.usage),
    }


def _tool_call_json(p: ToolCall) -> dict[str, Any]:
    return {"id": p.id, "type": "function", "function": {"name": p.name, "arguments": p.arguments}}


def error_json(err: GatewayError) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": ERROR_TYPE[err.kind],
            "param": err.param,
            "code": err.code,  # model_not_found only where a model is unknown (router, /v1/models/{id})
        }
    }


class StreamEncoder:
    """Renders canonical events as OpenAI `chat.completion.chunk` SSE lines."""

    def __init__(self, model: str, include_usage: bool) -> None:
        self.model = model
        self.include_usage = include_usage
        self.id = completion_id()
        self.created = int(time.time())
        self._tool_ordinal: dict[int, int] = {}

    def encode(self, ev: Event) -> Iterator[bytes]:
        if isinstance(ev, Start):
            yield self._chunk({"role": "assistant", "content": ""})
        elif isinstance(ev, TextDelta):
            yield self._chunk({"content": ev.text})
        elif isinstance(ev, ThinkingDelta):
            yield self._chunk({"reasoning_content": ev.text})
        elif isinstance(ev, ToolCallStart):
            k = self._tool_ordinal[ev.index] = len(self._tool_ordinal)
            call = {"index": k, "id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}}
            yield self._chunk({"tool_calls": [call]})
        elif isinstance(ev, ToolArgsDelta):
            k = self._tool_ordinal[ev.index]
            yield self._chunk({"tool_calls": [{"index": k, "function": {"arguments": ev.fragment}}]})
        elif isinstance(ev, Finish):
            yield self._chunk({}, FINISH_REASON[ev.stop_reason])
            if self.include_usage:
                yield _sse(self._envelope([], usage=usage_json(ev.usage)))
            yield b"data: [DONE]\n\n"
        elif isinstance(ev, Error):
            yield _sse(error_json(ev.error))

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return _sse(self._envelope([choice]))

    def _envelope(self, choices: list[Any], usage: Any = None) -> dict[str, Any]:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage
        return body


def _sse(body: Any) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


# ---- canonical → upstream --------------------------------------------------------------------


def request_json(req: ChatRequest, upstream_model: str) -> dict[str, Any]:
    """The body an OpenAI-compatible upstream takes for a canonical request."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": req.system_text()})
    for m in req.messages:
        messages.extend(_message_json(m))
    body: dict[str, Any] = {"model": upstream_model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.max_tokens is not None:
        body["max_tokens"] = req.max_tokens
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop:
        body["stop"] = req.stop
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description or "", "parameters": t.parameters}}
            for t in req.tools
        ]
    if req.tool_choice is not None:
        _apply_tool_choice(body, req.tool_choice, bool(req.tools))
    if req.response_format is not None:
        body["response_format"] = _response_format_json(req.response_format)
    return body


def _message_json(m: Message) -> Iterator[dict[str, Any]]:
    if m.role == "assistant":
        text = "".join(p.text for p in m.parts if isinstance(p, Text))
        calls = [_tool_call_json(p) for p in m.parts if isinstance(p, ToolCall)]
        msg: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = calls
        yield msg
        return
    # Tool results are separate `tool` messages in OpenAI's format, before the user's own parts.
    rest: list[dict[str, Any]] = []
    for p in m.parts:
        if isinstance(p, ToolResult):
            yield {"role": "tool", "tool_call_id": p.tool_call_id, "content": _result_text(p)}
        elif isinstance(p, Text):
            rest.append({"type": "text", "text": p.text})
        elif isinstance(p, Image):
            url = p.url or f"data:{p.media_type};base64,{p.data}"
            rest.append({"type": "image_url", "image_url": {"url": url}})
    if rest:
        only_text = all(r["type"] == "text" for r in rest)
        yield {"role": "user", "content": "".join(r["text"] for r in rest) if only_text else rest}


def _result_text(p: ToolResult) -> str:
    return "".join(c.text for c in p.content if isinstance(c, Text))


def _apply_tool_choice(body: dict[str, Any], choice: ToolChoice, has_tools: bool) -> None:
    if has_tools:
        if choice.mode == "tool":
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "none": "none", "any": "required"}[choice.mode]
    if choice.disable_parallel and has_tools:
        body["parallel_tool_calls"] = False


def _response_format_json(rf: ResponseFormat) -> dict[str, Any]:
    if rf.type == "json_schema":
        spec = {"name": rf.name or "response", "schema": rf.schema, "strict": rf.strict}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": rf.type}


# ---- upstream → canonical --------------------------------------------------------------------


def usage_from_json(u: dict[str, Any] | None) -> Usage:
    if not u:
        return Usage()
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Usage(u.get("prompt_tokens") or 0, u.get("completion_tokens") or 0, cached)


def response_from_json(body: dict[str, Any]) -> ChatResponse:
    """The canonical response for an upstream's ChatCompletion body."""
    choice = (body.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[Part] = []
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if reasoning:
        content.append(Thinking(reasoning))
    if msg.get("content"):
        content.append(Text(msg["content"]))
    for tc in msg.get("tool_calls") or []:
        fn = tc.get("function") or {}
        content.append(ToolCall(tc.get("id") or _call_id(), fn.get("name", ""), fn.get("arguments") or "{}"))
    return ChatResponse(
        id=body.get("id") or completion_id(),
        model=body.get("model", ""),
        content=content,
        stop_reason=STOP_REASON.get(choice.get("finish_reason") or "stop", StopReason.END_TURN),
        usage=usage_from_json(body.get("usage")),
        created=body.get("created") or int(time.time()),
    )


def upstream_error(status: int, body: Any, retry_after: float | None = None) -> GatewayError:
    """The canonical error for an OpenAI-style error body."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or err)
    elif isinstance(err, str):
        message = err
    else:
        message = str(body)[:500] or f"upstream returned HTTP {status}"
    return error_for_status(status, message, retry_after)


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ChunkDecoder:
    """Turns an upstream's `chat.completion.chunk` objects into canonical events."""

    def __init__(self) -> None:
        self.started = False
        self.next_index = 0
        self.text_index: int | None = None
        self.thinking_index: int | None = None
        self.tool_index: dict[int, int] = {}
        self.open: set[int] = set()
        self.finish_reason: str | None = None
        self.usage = Usage()

    def feed(self, chunk: dict[str, Any]) -> Iterator[Event]:
        if "error" in chunk and not chunk.get("choices"):
            raise upstream_error(500, chunk)
        if not self.started:
            self.started = True
            yield Start(chunk.get("id") or completion_id(), chunk.get("model", ""))
        if chunk.get("usage"):
            self.usage = usage_from_json(chunk["usage"])
        for choice in chunk.get("choices") or []:
            yield from self._delta(choice.get("delta") or {})
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _delta(self, delta: dict[str, Any]) -> Iterator[Event]:
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            if self.thinking_index is None:
                self.thinking_index = self._open_block()
            yield ThinkingDelta(self.thinking_index, reasoning)
        if delta.get("content"):
            if self.text_index is None:
                self.text_index = self._open_block()
            yield TextDelta(self.text_index, delta["content"])
        for tc in delta.get("tool_calls") or []:
            k = tc.get("index", 0)
            fn = tc.get("function") or {}
            if k not in self.tool_index:
                self.text_index = None  # text after a tool call starts a new block
                self.tool_index[k] = idx = self._open_block()
                yield ToolCallStart(idx, tc.get("id") or _call_id(), fn.get("name") or "")
            if fn.get("arguments"):
                yield ToolArgsDelta(self.tool_index[k], fn["arguments"])

    def _open_block(self) -> int:
        idx = self.next_index
        self.next_index += 1
        self.open.add(idx)
        return idx

    def finish(self) -> Iterator[Event]:
        """Events that close the stream once the upstream sent [DONE] (or simply ended)."""
        if not self.started:
            yield Start(completion_id(), "")
        for idx in sorted(self.open):
            yield BlockStop(idx)
        self.open.clear()
        reason = STOP_REASON.get(self.finish_reason or "stop", StopReason.END_TURN)
        yield Finish(reason, self.usage)
