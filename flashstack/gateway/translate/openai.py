"""OpenAI chat completions ⇄ canonical types, for clients (inbound) and upstreams (outbound)."""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Iterator
from typing import Any

from flashstack.gateway.core import (
    ESTIMATE_FIELD,
    SAME_RAW,
    BlockStop,
    ChatRequest,
    ChatResponse,
    Error,
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
from flashstack.gateway.vision import image_from_url
from flashstack.gateway.wire import openai as w
from flashstack.gateway.wire.openai import error_json

WIRE = "openai"

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


# ---- client → canonical ----------------------------------------------------------------------

# Keys each object's typed canonical fields stand for; everything else goes to its `extra`.
_TOP_REBUILT = frozenset({"model", "messages"})  # the gateway renames the model, edits the messages
_TEXT_KEYS = frozenset({"type", "text"})
_IMAGE_KEYS = frozenset({"type", "image_url"})
_CALL_KEYS = frozenset({"id", "type", "function"})
REASONING_BUDGET = {"minimal": 1024, "low": 1024, "medium": 4096, "high": 16384}


def to_canonical(req: w.ChatCompletionRequest, body: dict[str, Any]) -> ChatRequest:
    """The canonical request for an OpenAI chat-completions request; `body`, its JSON, gives the
    values `extra` keeps (exactly as sent: pydantic would turn 1 into 1.0)."""
    system: list[Text] = []
    messages: list[Message] = []
    for i, (m, raw) in enumerate(zip(req.messages, body["messages"])):
        param = f"messages[{i}]"
        if isinstance(m, w.SystemMessage):
            if messages:  # after the conversation began: kept where it stands
                messages.append(Message("system", [_system_text(m, raw)]))
            else:
                system.append(_system_text(m, raw))
        elif isinstance(m, w.UserMessage):
            parts = _user_parts(m.content, raw.get("content"), param)
            messages.append(
                Message("user", parts, _extra(raw, _MSG_KEYS), isinstance(m.content, str))
            )
        elif isinstance(m, w.AssistantMessage):
            messages.append(assistant_message(raw))
        elif isinstance(m, w.ToolMessage):
            messages.append(Message("user", [_tool_result(m, raw)]))
    if not messages:
        raise invalid_request(
            "messages must contain at least one user or assistant message", "messages"
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    metadata = dict(req.metadata or {})
    if req.user:
        metadata["user"] = req.user
    extra = {k: v for k, v in body.items() if k not in _TOP_REBUILT}
    extensions = {k: extra.pop(k) for k in GATEWAY_FIELDS if k in extra}
    return ChatRequest(
        model=req.model,
        messages=messages,
        system=system,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=stop,
        tools=[_tool(t, raw) for t, raw in zip(req.tools or [], body.get("tools") or [])],
        tool_choice=_tool_choice(req.tool_choice, req.parallel_tool_calls),
        response_format=_response_format(req.response_format),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        metadata=metadata,
        extensions=extensions,
        seed=req.seed,
        reasoning=Reasoning(req.reasoning_effort) if req.reasoning_effort else None,
        wire=WIRE,
        extra=extra,
    )


_MSG_KEYS = frozenset({"role", "content"})


def _extra(raw: dict[str, Any], modelled: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k not in modelled}


def _system_text(m: w.SystemMessage, raw: dict[str, Any]) -> Text:
    # One Text per system/developer message; its extra is the message's other keys (role, name, …),
    # and a list-form content, so that the same wire gets the message back as sent.
    extra = {k: v for k, v in raw.items() if k != "content" or not isinstance(v, str)}
    return Text(_text_of(m.content), extra=extra)


def system_parts(t: Text) -> list[Text] | None:
    """The content parts of a system or developer message as sent in a list, one Text each (None:
    it came as one string); what a wire of system blocks (Anthropic's) takes them as."""
    content = t.extra.get("content")
    if not isinstance(content, list):
        return None
    return [
        Text(str(p.get("text", "")), p.get("cache_control"), _extra(p, _TEXT_PART_KEYS))
        for p in content
        if isinstance(p, dict)
    ]


def _text_of(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(getattr(p, "text", None) or getattr(p, "refusal", "") or "" for p in content)


def _user_parts(content: str | list[Any], raw: Any, param: str) -> list[Part]:
    if isinstance(content, str):
        return [Text(content)]
    parts: list[Part] = []
    for j, (p, rp) in enumerate(zip(content, raw)):
        if isinstance(p, w.TextPart):
            parts.append(Text(p.text, rp.get("cache_control"), _extra(rp, _TEXT_PART_KEYS)))
        elif isinstance(p, w.ImagePart):
            img = image_from_url(p.image_url.url, f"{param}.content[{j}].image_url.url")
            img.extra = _image_extra(rp)
            parts.append(img)
        else:
            parts.append(Opaque(WIRE, rp))
    return parts


_TEXT_PART_KEYS = frozenset({"type", "text", "cache_control"})


def _image_extra(rp: dict[str, Any]) -> dict[str, Any]:
    extra = _extra(rp, _IMAGE_KEYS)
    inner = {k: v for k, v in rp["image_url"].items() if k != "url"}
    if inner:
        extra["image_url"] = inner
    return extra


def assistant_message(raw: dict[str, Any]) -> Message:
    """An assistant message's JSON as canonical parts, its every other key in `extra`: a client's
    own (validated), or an upstream's reply a session stores to send back on this wire as it
    came."""
    parts: list[Part] = []
    content = raw.get("content")
    if isinstance(content, str) and content:
        parts.append(Text(content))
    elif isinstance(content, list):
        for rp in content:
            if rp.get("type") == "text":
                parts.append(
                    Text(rp.get("text", ""), rp.get("cache_control"), _extra(rp, _TEXT_PART_KEYS))
                )
            else:
                parts.append(Opaque(WIRE, rp))
    calls = raw.get("tool_calls") or []
    parts += [_tool_call(rtc, _extra(rtc, _CALL_KEYS)) for rtc in calls]
    # content and tool_calls stay in extra when they rendered to nothing ("", null, []): sent
    # back as they came.
    modelled = {"role"} | ({"content"} if content else set()) | ({"tool_calls"} if calls else set())
    return Message("assistant", parts, _extra(raw, frozenset(modelled)), isinstance(content, str))


def _tool_call(raw: dict[str, Any], extra: dict[str, Any] | None = None) -> ToolCall:
    """A tool call of OpenAI's JSON; `extra`: its own keys to send back on the same wire."""
    fn = raw.get("function") or {}
    args = fn.get("arguments") or "{}"
    return ToolCall(raw.get("id") or _call_id(), fn.get("name", ""), args, extra=extra or {})


def _tool_result(m: w.ToolMessage, raw: dict[str, Any]) -> ToolResult:
    if isinstance(m.content, str):
        content: list[Text | Image] = [Text(m.content)]
    else:
        content = [
            Text(p.text, p_raw.get("cache_control"), _extra(p_raw, _TEXT_PART_KEYS))
            for p, p_raw in zip(m.content, raw["content"])
        ]
    extra = _extra(raw, frozenset({"role", "content", "tool_call_id"}))
    return ToolResult(m.tool_call_id, content, extra=extra, plain=isinstance(m.content, str))


def _tool(t: w.ToolDef, raw: dict[str, Any]) -> Tool:
    if t.function is None:  # a custom tool: same wire only
        return Tool(str(raw.get(t.type, {}).get("name", t.type)), None, {}, extra={"type": t.type})
    params = t.function.parameters or {"type": "object", "properties": {}}
    return Tool(t.function.name, t.function.description, params, strict=t.function.strict)


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
        raise invalid_request(
            "response_format json_schema needs json_schema.schema", "response_format"
        )
    js = rf.json_schema
    return ResponseFormat("json_schema", js.schema_, js.name, bool(js.strict))


# ---- canonical → client ----------------------------------------------------------------------


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def usage_json(u: Usage) -> dict[str, Any]:
    # OpenAI's prompt_tokens include cached ones; canonical input_tokens (Anthropic's) do not.
    prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    body: dict[str, Any] = w.usage_body(prompt, u.output_tokens)
    if u.cache_read_input_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": u.cache_read_input_tokens}
    if u.reasoning_tokens:
        body["completion_tokens_details"] = {"reasoning_tokens": u.reasoning_tokens}
    if u.estimated:  # the gateway's count, not the upstream's (providers/usage.py)
        body[ESTIMATE_FIELD] = u.estimated
    return body


def response_json(resp: ChatResponse, model: str) -> dict[str, Any]:
    """An OpenAI ChatCompletion body for a canonical response (an OpenAI upstream's
    own, renamed)."""
    if resp.raw is not None and resp.raw.wire == WIRE:
        body = resp.raw.items[0][1]
        body["model"] = model
        if resp.usage.estimated and not body.get("usage"):  # the upstream sent none: ours
            body["usage"] = usage_json(resp.usage)
        return body
    text = "".join(p.text for p in resp.content if isinstance(p, Text))
    tool_calls = [_stored_call_json(p) for p in resp.content if isinstance(p, ToolCall)]
    message: dict[str, Any] = {"role": "assistant", "content": text or None, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    reasoning = "".join(p.text for p in resp.content if isinstance(p, Thinking))
    if reasoning:
        message["reasoning_content"] = reasoning
    message.update(resp.extra)  # a stored same-wire reply's own keys (an idempotent replay)
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


def _stored_call_json(p: ToolCall) -> dict[str, Any]:
    return {**p.extra, **_tool_call_json(p)}


class StreamEncoder:
    """Renders canonical events as OpenAI `chat.completion.chunk` SSE lines.

    Events decoded from an OpenAI upstream's chunks carry them (`raw`): those chunks go out as they
    came, the model renamed, and the usage the gateway asked for removed unless the
    client asked too.
    """

    def __init__(self, model: str, include_usage: bool, dropped: set[str] | None = None) -> None:
        self.model = model
        self.include_usage = include_usage
        # the exchange's: named again, complete, on a translated stream's last chunk
        self.dropped = dropped
        self.id = completion_id()
        self.created = int(time.time())
        self._tool_ordinal: dict[int, int] = {}

    def encode(self, ev: Event) -> Iterator[bytes]:
        raw = ev.raw if not isinstance(ev, Error) else None
        if raw is not None and (raw is SAME_RAW or raw.wire == WIRE):
            yield from self._raw(raw)
            if isinstance(ev, Finish):
                if self.include_usage and ev.usage.estimated:  # the upstream sent no usage chunk
                    yield w.sse_event(self._envelope([], usage=usage_json(ev.usage)))
                yield w.SSE_DONE
        elif isinstance(ev, Start):
            yield self._chunk({"role": "assistant", "content": ""})
        elif isinstance(ev, TextDelta):
            yield self._chunk({"content": ev.text})
        elif isinstance(ev, ThinkingDelta):
            yield self._chunk({"reasoning_content": ev.text})
        elif isinstance(ev, ToolCallStart):
            k = self._tool_ordinal[ev.index] = len(self._tool_ordinal)
            call = {
                "index": k,
                "id": ev.id,
                "type": "function",
                "function": {"name": ev.name, "arguments": ""},
            }
            yield self._chunk({"tool_calls": [call]})
        elif isinstance(ev, ToolArgsDelta):
            k = self._tool_ordinal[ev.index]
            yield self._chunk(
                {"tool_calls": [{"index": k, "function": {"arguments": ev.fragment}}]}
            )
        elif isinstance(ev, Finish):
            yield self._chunk({}, FINISH_REASON[ev.stop_reason], self.dropped)
            if self.include_usage:
                yield w.sse_event(self._envelope([], usage=usage_json(ev.usage)))
            yield w.SSE_DONE
        elif isinstance(ev, Error):
            yield w.sse_event(error_json(ev.error))

    def _raw(self, raw: Raw) -> Iterator[bytes]:
        for _, chunk in raw.items:
            if not self.include_usage and "usage" in chunk:
                del chunk["usage"]
                if not chunk.get("choices"):
                    continue  # the usage chunk only the gateway asked for
            if "model" in chunk:
                chunk["model"] = self.model
            # A chunk the gateway adds (a usage it counted) carries the upstream's
            # id, as the others.
            self.id, self.created = chunk.get("id", self.id), chunk.get("created", self.created)
            yield w.sse_event(chunk)

    def _chunk(
        self,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        dropped: set[str] | None = None,
    ) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        body = self._envelope([choice])
        if dropped:
            body[fields.DROPPED_FIELD] = ",".join(sorted(dropped))
        return w.sse_event(body)

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


# ---- canonical → upstream --------------------------------------------------------------------


def request_json(req: ChatRequest, upstream_model: str) -> dict[str, Any]:
    """The body an OpenAI-compatible upstream takes for a canonical request.

    From an OpenAI client: its body as sent (`req.extra`), with the model renamed and the messages
    rendered back from the canonical ones (sessions, compression and image preparation edit those).
    """
    if req.wire == WIRE:
        body = dict(req.extra)
        body["model"] = upstream_model
        # `req`: a session's history may hold the other wire's blocks (thinking),
        # named where dropped.
        body["messages"] = [
            *(_system_json(t) for t in req.system),
            *_messages_json(req.messages, True, req),
        ]
        return body
    fields.check_cross(req, WIRE)
    return _cross_json(req, upstream_model)


def _system_json(t: Text) -> dict[str, Any]:
    return {"role": "system", "content": t.text, **t.extra}


def _cross_json(req: ChatRequest, upstream_model: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if req.system:
        _note_cache(req, any(t.cache_control for t in req.system), "system[].cache_control")
        _note_cache(req, any(t.extra.get("citations") for t in req.system), "system[].citations")
        messages.append({"role": "system", "content": req.system_text()})
    messages.extend(_messages_json(req.messages, same=False, req=req))
    body: dict[str, Any] = {"model": upstream_model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.max_tokens is not None:
        body["max_tokens"] = req.max_tokens
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.top_k is not None:
        req.exchange.dropped.add("top_k")
    if req.stop:
        body["stop"] = req.stop
    if req.tools:
        body["tools"] = [_cross_tool_json(req, t) for t in req.tools]
    if req.tool_choice is not None:
        _apply_tool_choice(body, req.tool_choice, bool(req.tools))
    if req.response_format is not None:
        body["response_format"] = _response_format_json(req.response_format)
    if req.metadata.get("user_id"):
        body["user"] = req.metadata["user_id"]
    config = req.extra.get("output_config")
    if isinstance(config, dict):  # format went to response_format; the rest has no counterpart
        req.exchange.dropped.update(f"output_config.{k}" for k in config if k != "format")
    return body


def _cross_tool_json(req: ChatRequest, t: Tool) -> dict[str, Any]:
    kind = t.extra.get("type")
    if kind not in (None, "custom"):
        fields.refuse_part(
            req.wire or "", f"tools[].type={kind}", WIRE, "server tools run on Anthropic's side"
        )
    _note_cache(req, t.cache_control is not None, "tools[].cache_control")
    for name in t.extra:
        if name != "type":
            req.exchange.dropped.add(f"tools[].{name}")
    if t.strict is not None:
        req.exchange.dropped.add("tools[].strict")
    fn = {"name": t.name, "description": t.description or "", "parameters": t.parameters}
    return {"type": "function", "function": fn}


def _note_cache(req: ChatRequest, present: bool, name: str) -> None:
    if present:
        req.exchange.dropped.add(name)


def _messages_json(
    messages: list[Message], same: bool, req: ChatRequest | None = None
) -> Iterator[dict[str, Any]]:
    for m in messages:
        yield from _message_json(m, same, req)


def _message_json(m: Message, same: bool, req: ChatRequest | None) -> Iterator[dict[str, Any]]:
    extra = m.extra if same else {}
    if m.role == "assistant":
        yield _assistant_json(m, extra, same, req)
        return
    if m.role == "system":  # an instruction mid-conversation: a system message where it stood
        texts = [p for p in m.parts if isinstance(p, Text)]
        if same and len(texts) == 1:
            yield _system_json(texts[0])
        else:
            yield {"role": "system", "content": "".join(p.text for p in texts)}
        return
    # Tool results are separate `tool` messages in OpenAI's format, before the user's own parts.
    rest: list[dict[str, Any]] = []
    for p in m.parts:
        if isinstance(p, ToolResult):
            yield _tool_message_json(p, same, req)
        else:
            part = _part_json(p, same, req)
            if part is not None:
                rest.append(part)
    if rest:
        # Text only goes as one string, unless the client sent parts (the other wire's
        # blocks: a string).
        plain = (m.plain or not same) and all(r.keys() == _TEXT_KEYS for r in rest)
        content: Any = "".join(r["text"] for r in rest) if plain else rest
        yield {**extra, "role": "user", "content": content}


def _assistant_json(
    m: Message, extra: dict[str, Any], same: bool, req: ChatRequest | None
) -> dict[str, Any]:
    parts = [
        q
        for q in (_part_json(p, same, req) for p in m.parts if not isinstance(p, ToolCall))
        if q is not None
    ]
    calls = [
        _stored_call_json(p) if same else _tool_call_json(p)
        for p in m.parts
        if isinstance(p, ToolCall)
    ]
    if (
        not same
        and req is not None
        and any(isinstance(p, ToolCall) and p.cache_control for p in m.parts)
    ):
        req.exchange.dropped.add("messages[].content[].cache_control")
    msg: dict[str, Any] = {**extra, "role": "assistant"}
    if parts:
        plain = (m.plain or not same) and all(q.keys() == _TEXT_KEYS for q in parts)
        msg["content"] = "".join(q["text"] for q in parts) if plain else parts
    elif not same:
        msg["content"] = None
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tool_message_json(p: ToolResult, same: bool, req: ChatRequest | None) -> dict[str, Any]:
    texts = [c for c in p.content if isinstance(c, Text)]
    if not same:
        if len(texts) < len(p.content):
            fields.refuse_part(
                req.wire if req and req.wire else "",
                "messages[].content[].type=tool_result with an image",
                WIRE,
                "tool messages carry text only",
            )
        if p.is_error and req is not None:
            req.exchange.dropped.add("messages[].content[].is_error")
        if p.cache_control is not None and req is not None:
            req.exchange.dropped.add("messages[].content[].cache_control")
        return {
            "role": "tool",
            "tool_call_id": p.tool_call_id,
            "content": "".join(c.text for c in texts),
        }
    if p.plain and all(not t.extra and t.cache_control is None for t in texts):
        content: Any = "".join(t.text for t in texts)
    else:
        content = [_text_json(c) for c in texts]
    return {**p.extra, "role": "tool", "tool_call_id": p.tool_call_id, "content": content}


def _text_json(p: Text) -> dict[str, Any]:
    body = {**p.extra, "type": "text", "text": p.text}
    if p.cache_control is not None:
        body["cache_control"] = p.cache_control
    return body


def _part_json(p: Part, same: bool, req: ChatRequest | None) -> dict[str, Any] | None:
    """One content part; across wires what has no counterpart is refused or dropped (fields.py)."""
    if isinstance(p, Text):
        if same:
            return _text_json(p)
        if req is not None:
            _note_cache(req, p.cache_control is not None, "messages[].content[].cache_control")
            _note_cache(req, bool(p.extra.get("citations")), "messages[].content[].citations")
        return {"type": "text", "text": p.text}
    if isinstance(p, Image):
        url = p.url or f"data:{p.media_type};base64,{p.data}"
        if same:
            extra = dict(p.extra)
            inner = {**extra.pop("image_url", {}), "url": url}
            return {**extra, "type": "image_url", "image_url": inner}
        if req is not None:
            _note_cache(req, p.cache_control is not None, "messages[].content[].cache_control")
        return {"type": "image_url", "image_url": {"url": url}}
    if isinstance(p, Opaque):
        if p.wire == WIRE:
            return p.block
        return _cross_opaque(p, req)
    if isinstance(p, Thinking | RedactedThinking):
        if req is not None:
            kind = "thinking" if isinstance(p, Thinking) else "redacted_thinking"
            req.exchange.dropped.add(f"messages[].content[].type={kind}")
        return None
    return None


def _cross_opaque(p: Opaque, req: ChatRequest | None) -> dict[str, Any] | None:
    name = f"messages[].content[].type={p.type}"
    if p.type == "document" and (part := documents.document_as_openai(p.block)) is not None:
        if req is not None:
            for key in ("cache_control", "citations", "context"):
                if key in p.block:
                    req.exchange.dropped.add(f"messages[].content[].{key}")
        return part
    row = fields.part_row(p.wire, name)
    if row is not None and row.cross is fields.Fate.DROPPED:
        if req is not None:
            req.exchange.dropped.add(name)
        return None
    fields.refuse_part(p.wire, name, WIRE, row.to if row else "no counterpart")
    return None


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
    reasoning = (u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    # Canonical input tokens are Anthropic's: without the cached ones (OpenAI counts those in).
    prompt = u.get("prompt_tokens") or 0
    return Usage(max(0, prompt - cached), u.get("completion_tokens") or 0, cached, 0, reasoning)


def response_from_json(
    body: dict[str, Any], keep_raw: bool = False, dropped: set[str] | None = None
) -> ChatResponse:
    """The canonical response for an upstream's ChatCompletion body (kept whole with `keep_raw`;
    otherwise what the other wire cannot carry is named in `dropped`)."""
    if not keep_raw and dropped is not None:
        dropped.update(fields.dropped_response_fields(WIRE, body))
    choice = (body.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[Part] = []
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if reasoning:
        content.append(Thinking(reasoning))
    if msg.get("content"):
        content.append(Text(msg["content"]))
    content += [_tool_call(tc) for tc in msg.get("tool_calls") or []]
    return ChatResponse(
        id=body.get("id") or completion_id(),
        model=body.get("model", ""),
        content=content,
        stop_reason=STOP_REASON.get(choice.get("finish_reason") or "stop", StopReason.END_TURN),
        usage=usage_from_json(body.get("usage")),
        created=body.get("created") or int(time.time()),
        raw=Raw(WIRE, [("", body)]) if keep_raw else None,
    )


def whole_reply(body: dict[str, Any]) -> Message:
    """A ChatCompletion's (first) message whole: what a session stores of a same-wire reply."""
    return assistant_message((body.get("choices") or [{}])[0].get("message") or {})


# Delta keys whose value is replaced, not appended to, when a stream is gathered into its message.
_WHOLE_KEYS = frozenset({"role", "type", "id", "index", "expires_at"})


class MessageAccumulator:
    """A stream's chunks gathered into the (first choice's) message they carry, every key kept: what
    a session stores of a same-wire stream. Strings are appended (content, refusal, reasoning, audio
    data), lists extended (annotations), objects merged; tool calls are merged by their index."""

    def __init__(self) -> None:
        self.message: dict[str, Any] = {}
        self._calls: dict[int, dict[str, Any]] = {}

    def feed(self, name: str, data: dict[str, Any]) -> None:
        for choice in data.get("choices") or []:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                delta = dict(choice.get("delta") or {})
                for call in delta.pop("tool_calls", None) or []:
                    k = call.get("index", 0)
                    _merge(self._calls.setdefault(k, {}), call)
                _merge(self.message, delta)

    def reply(self) -> Message:
        message = dict(self.message)
        if self._calls:
            message["tool_calls"] = [
                {k: v for k, v in self._calls[i].items() if k != "index"}
                for i in sorted(self._calls)
            ]
        return assistant_message(message)


def stored_reasoning(extra: dict[str, Any]) -> tuple[str, str] | None:
    """A stored same-wire reply's reasoning, as (its message key, its text): streamed as deltas."""
    for key in ("reasoning_content", "reasoning"):
        if isinstance(extra.get(key), str) and extra[key]:
            return key, extra[key]
    return None


def replay_chunks(resp: ChatResponse, ev: Event) -> list[dict[str, Any]]:
    """A stored reply's replayed event as the chunks an OpenAI upstream streams (an idempotent
    stream replay): each tool call's own keys in its first delta, the message's other keys (refusal,
    annotations, audio, unknown ones) in one delta before the finish, then the usage chunk, which
    the encoder removes for a client that did not ask."""
    created = resp.created or int(time.time())
    base = {
        "id": resp.id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": resp.model,
    }

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**base, "choices": [choice]}

    reasoning = stored_reasoning(resp.extra)
    if isinstance(ev, Start):
        return [chunk({"role": "assistant", "content": resp.extra.get("content", "")})]
    if isinstance(ev, TextDelta):
        return [chunk({"content": ev.text})]
    if isinstance(ev, ThinkingDelta):
        return [chunk({reasoning[0] if reasoning else "reasoning_content": ev.text})]
    if isinstance(ev, ToolCallStart | ToolArgsDelta):
        k = sum(isinstance(p, ToolCall) for p in resp.content[: ev.index])
        if isinstance(ev, ToolArgsDelta):
            return [chunk({"tool_calls": [{"index": k, "function": {"arguments": ev.fragment}}]})]
        own = resp.content[ev.index].extra  # type: ignore[union-attr]
        call = {
            **own,
            "index": k,
            "id": ev.id,
            "type": "function",
            "function": {"name": ev.name, "arguments": ""},
        }
        return [chunk({"tool_calls": [call]})]
    if isinstance(ev, Finish):
        streamed = {"role", "content", *(reasoning[:1] if reasoning else ())}
        rest = {k: v for k, v in resp.extra.items() if k not in streamed}
        chunks = [chunk(rest)] if rest else []
        chunks.append(chunk({}, FINISH_REASON[ev.stop_reason]))
        if not ev.usage.estimated:  # an estimate's usage chunk the encoder adds itself
            chunks.append({**base, "choices": [], "usage": usage_json(ev.usage)})
        return chunks
    return []


def _merge(into: dict[str, Any], delta: dict[str, Any]) -> None:
    for k, v in delta.items():
        have = into.get(k)
        if isinstance(have, str) and isinstance(v, str) and k not in _WHOLE_KEYS:
            into[k] = have + v
        elif isinstance(have, dict) and isinstance(v, dict):
            _merge(have, v)
        elif isinstance(have, list) and isinstance(v, list):
            have.extend(copy.deepcopy(v))
        elif v is not None or k not in into:
            into[k] = copy.deepcopy(v)  # the chunk itself goes on to the client untouched


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


def _as_response(chunk: dict[str, Any]) -> dict[str, Any]:
    """A chunk shaped as the response it is part of (each choice's delta as its message)."""
    choices = [
        {**c, "message": c.get("delta")} if isinstance(c, dict) else c
        for c in chunk.get("choices") or []
    ]
    return {**chunk, "choices": choices}


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ChunkDecoder:
    """Turns an upstream's `chat.completion.chunk` objects into canonical events.

    Only the first choice becomes canonical (n > 1 reaches only an OpenAI client, through `tap`).
    """

    def __init__(self, tap: RawTap | None = None, dropped: set[str] | None = None) -> None:
        self.tap = tap
        # translated: what the other wire cannot carry
        self.dropped = dropped if tap is None else None
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
        tap = self.tap
        if tap is None:
            if self.dropped is not None:
                self.dropped.update(fields.dropped_response_fields(WIRE, _as_response(chunk)))
            yield from self._events(chunk)
            return
        tap.add("", chunk)
        for ev in self._events(chunk):
            ev.raw = tap.take()
            yield ev

    def _events(self, chunk: dict[str, Any]) -> Iterator[Event]:
        if not self.started:
            self.started = True
            yield Start(chunk.get("id") or completion_id(), chunk.get("model", ""))
        if chunk.get("usage"):
            self.usage = usage_from_json(chunk["usage"])
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
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
        same = SAME_RAW if self.tap is not None else None
        if not self.started:
            yield Start(completion_id(), "", raw=same)
        for idx in sorted(self.open):
            yield BlockStop(idx, raw=same)
        self.open.clear()
        reason = STOP_REASON.get(self.finish_reason or "stop", StopReason.END_TURN)
        yield Finish(reason, self.usage, raw=self.tap.take() if self.tap is not None else None)
