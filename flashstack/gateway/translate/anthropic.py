"""Anthropic Messages ⇄ canonical types, for clients (inbound) and upstreams (outbound)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import orjson

from flashstack.gateway.core import (
    ESTIMATE_FIELD,
    SAME_RAW,
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
    Opaque,
    Part,
    Raw,
    Reasoning,
    RedactedThinking,
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
from flashstack.gateway.translate import documents, fields
from flashstack.gateway.translate.fields import GATEWAY_FIELDS
from flashstack.gateway.translate.raw import RawTap
from flashstack.gateway.vision import checked_base64_image
from flashstack.gateway.wire import anthropic as w

WIRE = "anthropic"

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

_TOP_REBUILT = frozenset({"model", "messages", "system"})  # renamed, edited by sessions/compression
_TEXT_KEYS = frozenset({"type", "text", "cache_control"})
_IMAGE_KEYS = frozenset({"type", "source", "cache_control"})
_TOOL_USE_KEYS = frozenset({"type", "id", "name", "input", "cache_control"})
_THINKING_KEYS = frozenset({"type", "thinking", "signature"})
_TOOL_KEYS = frozenset({"name", "description", "input_schema", "cache_control", "strict"})


def to_canonical(req: w.MessagesRequest, body: dict[str, Any]) -> ChatRequest:
    """The canonical request for an Anthropic Messages request; `body`, its JSON, gives the values
    `extra` keeps (exactly as sent)."""
    messages = [
        Message(
            m.role,
            _parts(m.content, raw["content"], f"messages[{i}].content"),
            _extra(raw, _MSG_KEYS),
            isinstance(m.content, str),
        )
        for i, (m, raw) in enumerate(zip(req.messages, body["messages"]))
    ]
    if isinstance(req.system, str):
        system = [Text(req.system)] if req.system else []
    else:
        system = [_text(b, raw) for b, raw in zip(req.system or [], body.get("system") or [])]
    metadata: dict[str, Any] = {}
    if req.metadata is not None:
        metadata = req.metadata.model_dump(exclude_none=True)
    extra = {k: v for k, v in body.items() if k not in _TOP_REBUILT}
    extensions = {k: extra.pop(k) for k in GATEWAY_FIELDS if k in extra}
    return ChatRequest(
        model=req.model,
        messages=messages,
        system=system,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=list(req.stop_sequences or []),
        tools=[_tool(t, raw) for t, raw in zip(req.tools or [], body.get("tools") or [])],
        tool_choice=_tool_choice(req.tool_choice),
        stream=bool(req.stream),
        metadata=metadata,
        extensions=extensions,
        reasoning=_reasoning(body.get("thinking")),
        response_format=_output_format(body.get("output_config")),
        wire=WIRE,
        extra=extra,
        system_plain=isinstance(req.system, str),
    )


_MSG_KEYS = frozenset({"role", "content"})


def _extra(raw: dict[str, Any], modelled: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k not in modelled}


def _text(b: w.TextBlock, raw: dict[str, Any]) -> Text:
    return Text(b.text, raw.get("cache_control"), _extra(raw, _TEXT_KEYS))


def _reasoning(thinking: Any) -> Reasoning | None:
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    return Reasoning(budget_tokens=budget if isinstance(budget, int) else None)


def _output_format(config: Any) -> ResponseFormat | None:
    """output_config.format (structured outputs) as the canonical response format,
    checked here too."""
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise invalid_request(
            'output_config.format must be {"type": "json_schema", "schema": {…}}',
            "output_config.format",
        )
    return ResponseFormat("json_schema", fmt["schema"], None, True)


def _tool(t: w.ToolDef, raw: dict[str, Any]) -> Tool:
    params = t.input_schema if t.input_schema is not None else {"type": "object", "properties": {}}
    strict = raw.get("strict")
    return Tool(
        t.name,
        t.description,
        params,
        raw.get("cache_control"),
        strict if isinstance(strict, bool) else None,
        _extra(raw, _TOOL_KEYS),
    )


def _parts(content: str | list[Any], raw: Any, param: str) -> list[Part]:
    if isinstance(content, str):
        return [Text(content)]
    parts: list[Part] = []
    for j, (b, rb) in enumerate(zip(content, raw)):
        p = f"{param}[{j}]"
        if isinstance(b, w.TextBlock):
            parts.append(_text(b, rb))
        elif isinstance(b, w.ImageBlock):
            parts.append(_image(b, rb, p))
        elif isinstance(b, w.ToolUseBlock):
            parts.append(
                ToolCall(
                    b.id,
                    b.name,
                    orjson.dumps(rb["input"]).decode(),
                    rb.get("cache_control"),
                    _extra(rb, _TOOL_USE_KEYS),
                )
            )
        elif isinstance(b, w.ToolResultBlock):
            parts.append(_tool_result(b, rb, p))
        elif isinstance(b, w.ThinkingBlock):
            parts.append(Thinking(b.thinking, b.signature, _extra(rb, _THINKING_KEYS)))
        elif isinstance(b, w.RedactedThinkingBlock):
            parts.append(RedactedThinking(b.data))
        else:
            parts.append(Opaque(WIRE, rb))
    return parts


def _image(b: w.ImageBlock, raw: dict[str, Any], param: str) -> Image | Opaque:
    if isinstance(b.source, w.Base64Source):
        img = checked_base64_image(b.source.media_type, b.source.data, f"{param}.source")
    elif isinstance(b.source, w.URLSource):
        img = Image(url=b.source.url)
    else:
        return Opaque(WIRE, raw)  # a Files API source: the same wire only
    img.cache_control = raw.get("cache_control")
    img.extra = _extra(raw, _IMAGE_KEYS)
    return img


def _tool_result(b: w.ToolResultBlock, raw: dict[str, Any], param: str) -> ToolResult | Opaque:
    if b.content is None:
        content: list[Text | Image] = []
    elif isinstance(b.content, str):
        content = [Text(b.content)]
    else:
        content = []
        for c, rc in zip(b.content, raw["content"]):
            if isinstance(c, w.TextBlock):
                content.append(_text(c, rc))
            elif isinstance(c, w.ImageBlock) and isinstance(c.source, w.Base64Source | w.URLSource):
                content.append(_image(c, rc, f"{param}.content"))  # type: ignore[arg-type]
            else:
                return Opaque(WIRE, raw)  # a document or search result inside: the same wire only
    # content and is_error stay in extra when they rendered to nothing ("", [], false): sent
    # back as they came.
    modelled = {"type", "tool_use_id", "cache_control"} | ({"content"} if content else set())
    extra = _extra(raw, frozenset(modelled | ({"is_error"} if b.is_error else set())))
    return ToolResult(
        b.tool_use_id,
        content,
        bool(b.is_error),
        raw.get("cache_control"),
        extra,
        isinstance(b.content, str),
    )


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
    body: dict[str, Any] = {
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "cache_creation_input_tokens": u.cache_creation_input_tokens,
        "cache_read_input_tokens": u.cache_read_input_tokens,
    }
    if u.estimated:  # the gateway's count, not the upstream's (providers/usage.py)
        body[ESTIMATE_FIELD] = u.estimated
    return body


def _block_json(p: Part) -> dict[str, Any]:
    # Extras and verbatim blocks are Anthropic's own (a same-wire reply stored for an
    # idempotent replay).
    if isinstance(p, Text):
        return {**p.extra, "type": "text", "text": p.text}
    if isinstance(p, Thinking):
        return {**p.extra, "type": "thinking", "thinking": p.text, "signature": p.signature or ""}
    if isinstance(p, ToolCall):
        return {**p.extra, "type": "tool_use", "id": p.id, "name": p.name, "input": _tool_input(p)}
    if isinstance(p, RedactedThinking):
        return {"type": "redacted_thinking", "data": p.data}
    if isinstance(p, Opaque) and p.wire == WIRE:
        return p.block
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
    """An Anthropic Message body for a canonical response (an Anthropic upstream's own, renamed)."""
    if resp.raw is not None and resp.raw.wire == WIRE:
        body = resp.raw.items[0][1]
        body["model"] = model
        return body
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
    """Renders canonical events as the Messages API's SSE event sequence.

    Events decoded from an Anthropic upstream carry its events (`raw`): those go out as they came
    (pings included), message_start's model renamed.
    """

    def __init__(self, model: str, dropped: set[str] | None = None) -> None:
        self.model = model
        # the exchange's: named again, complete, on a translated stream's message_delta
        self.dropped = dropped
        self.id = message_id()
        self._index: dict[int, int] = {}  # canonical block index → wire index (dense, in order)
        self._open: set[int] = set()
        self._input_tokens = 0

    def encode(self, ev: Event) -> Iterator[bytes]:
        raw = ev.raw if not isinstance(ev, Error) else None
        if raw is not None and (raw is SAME_RAW or raw.wire == WIRE):
            for name, data in raw.items:
                if name == "message_start" or data.get("type") == "message_start":
                    data.get("message", {})["model"] = self.model
                yield _event(name or str(data.get("type", "message")), data)
        elif isinstance(ev, Start):
            self._input_tokens = ev.usage.input_tokens
            usage = {"input_tokens": ev.usage.input_tokens, "output_tokens": 0}
            message = {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage,
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
        body = {"type": "message_delta", "delta": delta, "usage": usage}
        if self.dropped:
            body[fields.DROPPED_FIELD] = ",".join(sorted(self.dropped))
        yield _event("message_delta", body)
        yield _event("message_stop", {"type": "message_stop"})


def _event(name: str, body: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"


PING = _event("ping", {"type": "ping"})


# ---- canonical → upstream --------------------------------------------------------------------


def request_json(
    req: ChatRequest, upstream_model: str, default_max_tokens: int | None = None
) -> dict[str, Any]:
    """The body the Messages API takes for a canonical request.

    From an Anthropic client: its body as sent (`req.extra`), with the model renamed and the system
    prompt and messages rendered back from the canonical ones (sessions and compression edit those).
    """
    if req.wire == WIRE:
        return _same_wire_json(req, upstream_model, default_max_tokens)
    fields.check_cross(req, WIRE)
    return _cross_json(req, upstream_model, default_max_tokens)


def _same_wire_json(
    req: ChatRequest, upstream_model: str, default_max_tokens: int | None
) -> dict[str, Any]:
    body = dict(req.extra)
    body["model"] = upstream_model
    body.setdefault("max_tokens", req.max_tokens or default_max_tokens or DEFAULT_MAX_TOKENS)
    body["messages"] = _messages_json(req.messages, same=True)
    if req.system:
        one = req.system[0]
        if (
            req.system_plain
            and len(req.system) == 1
            and one.cache_control is None
            and not one.extra
        ):
            body["system"] = one.text
        else:
            body["system"] = [_text_json(t, True) for t in req.system]
    return body


def _cross_json(
    req: ChatRequest, upstream_model: str, default_max_tokens: int | None
) -> dict[str, Any]:
    # An instruction mid-conversation (an OpenAI system message after the first turn) joins the
    # system prompt: the Messages API takes one only up front.
    late = [t for m in req.messages if m.role == "system" for t in m.parts if isinstance(t, Text)]
    body: dict[str, Any] = {
        "model": upstream_model,
        "max_tokens": req.max_tokens or default_max_tokens or DEFAULT_MAX_TOKENS,
        "messages": _messages_json(
            [m for m in req.messages if m.role != "system"], same=False, req=req
        ),
    }
    if any(t.extra.get("name") for t in [*req.system, *late]):
        req.exchange.dropped.add("messages[].name")
    system = _cross_system(req, [*req.system, *late])
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
        body["tools"] = [_cross_tool_json(req, t) for t in req.tools]
        if req.tool_choice is not None:
            body["tool_choice"] = _tool_choice_json(req.tool_choice)
    user = req.metadata.get("user_id") or req.metadata.get("user")
    if user:
        body["metadata"] = {"user_id": user}
    if req.reasoning is not None:
        _apply_reasoning(body, req)
    if req.stream:
        body["stream"] = True
    return body


def _cross_system(req: ChatRequest, texts: list[Text]) -> str | list[dict[str, Any]]:
    """The system prompt: one string, or text blocks where a system message came as parts (each
    part a block, its cache_control kept: Anthropic's own marker)."""
    from flashstack.gateway.translate.openai import system_parts

    parts = [system_parts(t) for t in texts]
    instruction = _json_instruction(req.response_format) if req.response_format is not None else ""
    if all(p is None for p in parts):
        return "\n\n".join(t for t in [*(t.text for t in texts), instruction] if t)
    blocks: list[dict[str, Any]] = []
    for t, listed in zip(texts, parts):
        for part in listed if listed is not None else [Text(t.text)]:
            req.exchange.dropped.update(f"messages[].content[].{k}" for k in part.extra)
            if part.text:
                blocks.append(_cached({"type": "text", "text": part.text}, part.cache_control))
    if instruction:
        blocks.append({"type": "text", "text": instruction})
    return blocks


def _apply_reasoning(body: dict[str, Any], req: ChatRequest) -> None:
    """OpenAI's reasoning_effort as a thinking budget, when max_tokens leaves room for one."""
    from flashstack.gateway.translate.openai import REASONING_BUDGET

    assert req.reasoning is not None
    budget = req.reasoning.budget_tokens or REASONING_BUDGET.get(req.reasoning.effort or "", 0)
    if budget and budget < body["max_tokens"]:
        body["thinking"] = {"type": "enabled", "budget_tokens": budget}
        body.pop("temperature", None)  # thinking takes the default temperature only
        body.pop("top_k", None)
    else:
        req.exchange.dropped.add("reasoning_effort")


def _cross_tool_json(req: ChatRequest, t: Tool) -> dict[str, Any]:
    if t.extra.get("type") == "custom":
        fields.refuse_part(
            req.wire or "", "tools[].type=custom", WIRE, "free-text tools have no counterpart"
        )
    if t.strict is not None:
        req.exchange.dropped.add("tools[].function.strict")
    return {"name": t.name, "description": t.description or "", "input_schema": t.parameters}


def _json_instruction(rf: ResponseFormat) -> str:
    if rf.type == "json_schema" and rf.schema is not None:
        schema = orjson.dumps(rf.schema).decode()
        return (
            "Reply with one JSON value that conforms to this JSON Schema, and nothing else: "
            f"{schema}"
        )
    return "Reply with one JSON object and nothing else."


def _tool_choice_json(tc: ToolChoice) -> dict[str, Any]:
    body: dict[str, Any] = {"type": tc.mode}
    if tc.mode == "tool":
        body["name"] = tc.name
    if tc.disable_parallel and tc.mode != "none":
        body["disable_parallel_tool_use"] = True
    return body


def _messages_json(
    messages: list[Message], same: bool, req: ChatRequest | None = None
) -> list[dict[str, Any]]:
    if same:
        return [_same_message_json(m) for m in messages]
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.extra.get("name") and req is not None:
            req.exchange.dropped.add("messages[].name")
        blocks = [b for b in (_part_json(p, req) for p in m.parts) if b is not None]
        if m.role == "user":
            # The API wants tool results first in a user turn.
            blocks.sort(key=lambda b: b["type"] != "tool_result")
        if out and out[-1]["role"] == m.role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": m.role, "content": blocks})
    return out


def _same_message_json(m: Message) -> dict[str, Any]:
    if m.plain and len(m.parts) == 1 and isinstance(m.parts[0], Text):
        t = m.parts[0]
        if t.cache_control is None and not t.extra:
            return {**m.extra, "role": m.role, "content": t.text}
    return {**m.extra, "role": m.role, "content": [_same_part_json(p) for p in m.parts]}


def _text_json(p: Text, same: bool) -> dict[str, Any]:
    body = {**p.extra, "type": "text", "text": p.text} if same else {"type": "text", "text": p.text}
    if p.cache_control is not None and same:
        body["cache_control"] = p.cache_control
    return body


def _same_part_json(p: Part) -> dict[str, Any]:
    """A block as the client sent it: typed fields over its extra."""
    if isinstance(p, Text):
        return _text_json(p, True)
    # another wire's block (a session's history may hold one): mapped or refused
    if isinstance(p, Opaque):
        return p.block if p.wire == WIRE else _cross_opaque(p)  # type: ignore[return-value]
    if isinstance(p, Image):
        return _cached({**p.extra, **_image_json(p)}, p.cache_control)
    if isinstance(p, ToolCall):
        block = {
            **p.extra,
            "type": "tool_use",
            "id": p.id,
            "name": p.name,
            "input": _tool_input_or_400(p),
        }
        return _cached(block, p.cache_control)
    if isinstance(p, ToolResult):
        block = {**p.extra, "type": "tool_result", "tool_use_id": p.tool_call_id}
        if p.content:
            one = p.content[0]
            plain = p.plain and len(p.content) == 1 and isinstance(one, Text) and not one.extra
            block["content"] = (
                one.text
                if plain and isinstance(one, Text)
                else [
                    _text_json(c, True) if isinstance(c, Text) else _same_part_json(c)
                    for c in p.content
                ]
            )
        if p.is_error:
            block["is_error"] = True
        return _cached(block, p.cache_control)
    if isinstance(p, Thinking):
        block = {**p.extra, "type": "thinking", "thinking": p.text}
        if p.signature is not None:
            block["signature"] = p.signature
        return block
    if isinstance(p, RedactedThinking):
        return {"type": "redacted_thinking", "data": p.data}
    raise TypeError(f"{type(p).__name__} is not a message part")


def _cached(block: dict[str, Any], cache_control: dict[str, Any] | None) -> dict[str, Any]:
    if cache_control is not None:
        block["cache_control"] = cache_control
    return block


def _part_json(p: Part, req: ChatRequest | None) -> dict[str, Any] | None:
    if isinstance(p, Text):
        return {"type": "text", "text": p.text} if p.text else None
    if isinstance(p, Image):
        if p.extra and req is not None:
            req.exchange.dropped.add("messages[].content[].image_url.detail")
        return _image_json(p)
    if isinstance(p, ToolCall):
        return {"type": "tool_use", "id": p.id, "name": p.name, "input": _tool_input_or_400(p)}
    if isinstance(p, ToolResult):
        content = [
            _image_json(c) if isinstance(c, Image) else {"type": "text", "text": c.text}
            for c in p.content
        ]
        return {
            "type": "tool_result",
            "tool_use_id": p.tool_call_id,
            "content": content,
            "is_error": p.is_error,
        }
    if isinstance(p, Thinking) and p.signature:
        return {"type": "thinking", "thinking": p.text, "signature": p.signature}
    if isinstance(p, Opaque):
        return _cross_opaque(p)
    return None


def _cross_opaque(p: Opaque) -> dict[str, Any] | None:
    if p.type == "refusal":  # an earlier OpenAI answer that refused: its words, as text
        return {"type": "text", "text": str(p.block.get("refusal", ""))}
    if p.type == "file" and (block := documents.file_as_anthropic(p.block)) is not None:
        return block
    name = f"messages[].content[].type={p.type}"
    row = fields.part_row(p.wire, name)
    fields.refuse_part(p.wire, name, WIRE, row.to if row else "no counterpart")
    return None


def _tool_input_or_400(p: ToolCall) -> dict[str, Any]:
    try:
        value = orjson.loads(p.arguments or "{}")
    except orjson.JSONDecodeError:
        raise invalid_request(
            f"arguments of tool call {p.id!r} are not valid JSON", "messages"
        ) from None
    return value if isinstance(value, dict) else {"value": value}


def _image_json(p: Image) -> dict[str, Any]:
    if p.data is not None:
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": p.media_type, "data": p.data},
        }
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


def whole_content(blocks: list[dict[str, Any]]) -> list[Part]:
    """A reply's blocks with every key, and those the canonical types do not model verbatim: what a
    session stores of a same-wire reply, to replay it as it came (decoded only there: ~4 µs)."""
    return _content(blocks, whole=True)


def _content(blocks: list[dict[str, Any]], whole: bool) -> list[Part]:
    content: list[Part] = []
    for b in blocks:
        kind = b.get("type")
        extra = _extra(b, _REPLY_KEYS.get(kind, frozenset())) if whole else {}
        if kind == "text":
            content.append(Text(b.get("text", ""), extra=extra))
        elif kind == "tool_use":
            content.append(
                ToolCall(
                    b["id"], b["name"], orjson.dumps(b.get("input") or {}).decode(), extra=extra
                )
            )
        elif kind == "thinking":
            content.append(Thinking(b.get("thinking", ""), b.get("signature"), extra))
        elif kind == "redacted_thinking":
            content.append(RedactedThinking(b.get("data", "")))
        elif whole:  # a server tool's call or result, a block newer than the gateway
            content.append(Opaque(WIRE, b))
    return content


_REPLY_KEYS = {
    "text": frozenset({"type", "text"}),
    "tool_use": frozenset({"type", "id", "name", "input"}),
    "thinking": _THINKING_KEYS,
}


def response_from_json(
    body: dict[str, Any], keep_raw: bool = False, dropped: set[str] | None = None
) -> ChatResponse:
    """The canonical response for a Messages API response body (kept whole with `keep_raw`;
    otherwise what the other wire cannot carry is named in `dropped`)."""
    if not keep_raw and dropped is not None:
        dropped.update(fields.dropped_response_fields(WIRE, body))
    return ChatResponse(
        id=body.get("id") or message_id(),
        model=body.get("model", ""),
        content=_content(body.get("content") or [], whole=False),
        stop_reason=_stop_reason(body.get("stop_reason")),
        usage=usage_from_json(body.get("usage")),
        stop_sequence=body.get("stop_sequence"),
        raw=Raw(WIRE, [("", body)]) if keep_raw else None,
    )


class MessageAccumulator:
    """A stream's events gathered into the blocks of the message they carry, every key kept (what a
    session stores of a same-wire stream: citations, redacted thinking, server tools' blocks)."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, Any]] = {}
        self._json: dict[int, list[str]] = {}

    def feed(self, name: str, data: dict[str, Any]) -> None:
        kind = data.get("type", name)
        if kind == "content_block_start":
            self.blocks[data["index"]] = dict(data.get("content_block") or {})
        elif kind == "content_block_delta" and data.get("index") in self.blocks:
            self._delta(data["index"], self.blocks[data["index"]], data.get("delta") or {})

    def _delta(self, index: int, block: dict[str, Any], delta: dict[str, Any]) -> None:
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = block.get("text", "") + delta.get("text", "")
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature")
        elif kind == "citations_delta":
            block["citations"] = [*(block.get("citations") or []), delta.get("citation")]
        elif kind == "input_json_delta":
            self._json.setdefault(index, []).append(delta.get("partial_json", ""))

    def reply(self) -> Message | None:
        """The message (None if a tool's streamed input is not JSON: the caller keeps its own)."""
        for index, fragments in self._json.items():
            try:
                self.blocks[index]["input"] = orjson.loads("".join(fragments) or "{}")
            except orjson.JSONDecodeError:
                return None
        return Message(
            "assistant", whole_content([self.blocks[i] for i in sorted(self.blocks)]), plain=False
        )


def part_events(index: int, part: Part) -> list[tuple[str, dict[str, Any]]]:
    """A stored reply's part as the Messages API streams its block (an idempotent stream replay):
    started empty, then its deltas (text, citations, thinking, signature, a tool's input), then
    stopped; a block without deltas (redacted thinking, a server tool's result) whole
    at its start."""
    block = _block_json(part)
    head, deltas = dict(block), []
    kind = block.get("type")
    if kind == "text":
        head["text"] = ""
        deltas.append({"type": "text_delta", "text": block["text"]})
        if block.get("citations"):
            head["citations"] = None
            deltas += [{"type": "citations_delta", "citation": c} for c in block["citations"]]
    elif kind == "thinking":
        head["thinking"], head["signature"] = "", ""
        deltas += [
            {"type": "thinking_delta", "thinking": block["thinking"]},
            {"type": "signature_delta", "signature": block["signature"]},
        ]
    elif (
        isinstance(kind, str) and kind.endswith("tool_use") and isinstance(block.get("input"), dict)
    ):
        head["input"] = {}
        deltas.append(
            {"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}
        )
    return [
        (
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": head},
        ),
        *(
            ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})
            for d in deltas
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": index}),
    ]


def upstream_error(status: int, body: Any, retry_after: float | None = None) -> GatewayError:
    """The canonical error for a Messages API error body."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        kind = _ERROR_KIND.get(err.get("type", ""))
        message = str(err.get("message") or err)
        if kind is not None:
            return GatewayError(kind, message, status=status, retry_after=retry_after)
        return error_for_status(status, message, retry_after)
    return error_for_status(
        status, str(body)[:500] or f"upstream returned HTTP {status}", retry_after
    )


def _as_response(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """A stream event shaped as the part of a Message response it carries."""
    kind = data.get("type", name)
    if kind == "message_start":
        return data.get("message") or {}
    if kind == "content_block_start":
        return {"content": [data.get("content_block")]}
    delta = data.get("delta") or {}
    if kind == "content_block_delta" and delta.get("type") == "citations_delta":
        return {"content": [{"type": "text", "citations": [delta.get("citation")]}]}
    if kind == "message_delta":
        rest = {k: v for k, v in data.items() if k not in ("type", "delta")}
        return {**rest, **{k: v for k, v in delta.items() if k != "stop_reason"}}
    return {}


class EventDecoder:
    """Turns Messages API stream events into canonical events (kept whole for `tap`)."""

    def __init__(self, tap: RawTap | None = None, dropped: set[str] | None = None) -> None:
        self.tap = tap
        # translated: what the other wire cannot carry
        self.dropped = dropped if tap is None else None
        # blocks that are tool calls (a server tool's input is not one)
        self.tools: set[int] = set()
        self.usage = Usage()
        self.stop_reason: StopReason = StopReason.END_TURN
        self.stop_sequence: str | None = None

    def feed(self, name: str, data: dict[str, Any]) -> Iterator[Event]:
        tap = self.tap
        if tap is None:
            if self.dropped is not None:
                self.dropped.update(fields.dropped_response_fields(WIRE, _as_response(name, data)))
            yield from self._events(name, data)
            return
        tap.add(name, data)
        for ev in self._events(name, data):
            ev.raw = tap.take()
            yield ev

    def _events(self, name: str, data: dict[str, Any]) -> Iterator[Event]:
        kind = data.get("type", name)
        if kind == "message_start":
            msg = data.get("message") or {}
            self.usage = usage_from_json(msg.get("usage"))
            yield Start(
                msg.get("id") or message_id(), msg.get("model", ""), Usage(self.usage.input_tokens)
            )
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
            status = _KIND_STATUS.get(
                _ERROR_KIND.get((data.get("error") or {}).get("type", ""), ErrorKind.UPSTREAM), 500
            )
            raise upstream_error(status, data)

    def _block_start(self, index: int, block: dict[str, Any]) -> Iterator[Event]:
        kind = block.get("type")
        if kind == "tool_use":
            self.tools.add(index)
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
            if delta.get("partial_json") and index in self.tools:
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
