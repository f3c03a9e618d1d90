"""OpenAI Responses API ⇄ canonical types: a client's `/v1/responses` request in, its response out.

Every upstream gets the request through the canonical types (its own translator renders it), so a
Responses field is mapped, refused or dropped and named here, by the rows of
fields.RESPONSES_REQUEST: nothing is lost silently.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

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
    invalid_request,
)
from flashstack.gateway.translate import fields

# the same error body as chat completions
from flashstack.gateway.translate.openai import error_json
from flashstack.gateway.vision import image_from_url
from flashstack.gateway.wire import responses as w

WIRE = "responses"
ENCRYPTED = "reasoning.encrypted_content"
# Anthropic's redacted thinking travels in a reasoning item's encrypted_content, marked, so that it
# comes back as redacted thinking (a signature alone comes back as the thinking's signature).
_REDACTED = "fs-redacted:"
_ENDS = ("response.completed", "response.incomplete")
_EFFORT = {"minimal": "minimal", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}

__all__ = ["WIRE", "Options", "to_canonical", "response_json", "error_json", "StreamEncoder"]


@dataclass(slots=True)
class Options:
    """What the response object echoes back, and the gateway's own fields (store, include, …)."""

    body: dict[str, Any]
    store: bool = True  # the API's default
    include_encrypted: bool = False
    previous_response_id: str | None = None
    items: list[dict[str, Any]] = field(default_factory=list)  # this request's own input items
    namespaces: frozenset[str] = frozenset()  # of the request's namespace tools

    def call_item(
        self, item_id: str, call_id: str, name: str, arguments: str, status: str
    ) -> dict[str, Any]:
        """A function_call item; a namespaced tool's call names its namespace apart."""
        ns, sep, short = name.partition(NAMESPACE_SEP)
        item = _call_item(item_id, call_id, name, arguments, status)
        if sep and ns in self.namespaces:
            item.update(name=short, namespace=ns)
        return item


# ---- client → canonical ----------------------------------------------------------------------


def input_items(req: w.ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as a list of items (a bare string is one user message)."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return req.input


def to_canonical(
    req: w.ResponsesRequest,
    body: dict[str, Any],
    history: list[dict[str, Any]],
    passthrough: bool = False,
) -> ChatRequest:
    """The canonical request for a Responses request whose earlier items (previous_response_id) are
    `history`; fields with no counterpart are refused or noted as dropped (fields.py).

    `passthrough`: every deployment of the model serves the Responses API, which gets the body whole
    (`extra`); what the canonical types cannot hold (hosted tools, other item types)
    is kept verbatim.
    """
    system = [Text(req.instructions)] if req.instructions else []
    messages = _messages(history + input_items(req), system, len(history), passthrough)
    if not messages:
        raise invalid_request("input must contain at least one message or item", "input")
    creq = ChatRequest(
        model=req.model,
        messages=messages,
        system=system,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=[tool for i, t in enumerate(req.tools or []) for tool in _tools(t, i, passthrough)],
        tool_choice=_lenient(
            lambda: _tool_choice(req.tool_choice, req.parallel_tool_calls), passthrough, None
        ),
        response_format=_format(req.text),
        stream=bool(req.stream),
        metadata={"user_id": req.user} if req.user else {},
        reasoning=_reasoning(req.reasoning),
        wire=WIRE,
    )
    creq.extensions = {k: body[k] for k in fields.GATEWAY_FIELDS if k in body}
    if passthrough:
        creq.extra = {
            k: v for k, v in body.items() if k not in _NOT_PASSED and k not in creq.extensions
        }
        if history:  # the upstream does not know the gateway's ids: it gets the items themselves
            creq.extra["input"] = history + input_items(req)
    else:
        _check_fields(creq, body)
    return creq


_NOT_PASSED = frozenset({"model", "previous_response_id"})  # renamed; expanded into `input`


def _lenient(build: Any, passthrough: bool, kept: Any) -> Any:
    """`build()`; on a refusal, `kept` instead when the body passes through whole anyway."""
    try:
        return build()
    except GatewayError:
        if not passthrough:
            raise
        return kept


def _check_fields(req: ChatRequest, body: dict[str, Any]) -> None:
    """Refuse, or name as dropped, the top-level fields the canonical types do not carry."""
    for name, value in body.items():
        row = fields.RESPONSES_BY_NAME.get(name)
        if value is None or (
            row is not None
            and (row.cross in (fields.Fate.MAPPED, fields.Fate.GATEWAY) or value in row.harmless)
        ):
            continue
        if row is not None and row.cross is fields.Fate.REFUSED:
            raise invalid_request(
                f"{name} cannot be served by this gateway's upstreams ({row.to}); remove {name}",
                name,
            )
        req.exchange.dropped.add(name)
    text = body.get("text")
    if isinstance(text, dict) and text.get("verbosity") is not None:
        req.exchange.dropped.add("text.verbosity")
    for value in body.get("include") or []:
        if value == "message.output_text.logprobs":
            raise invalid_request(
                "include message.output_text.logprobs: log-probabilities are not returned "
                "through this gateway; remove it",
                "include",
            )
        if value != ENCRYPTED:
            req.exchange.dropped.add(f"include={value}")


def _messages(
    items: list[dict[str, Any]], system: list[Text], own_from: int, passthrough: bool
) -> list[Message]:
    out: list[Message] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise invalid_request(f"input[{i}] must be an object", f"input[{i - own_from}]")
        param = f"input[{i - own_from}]" if i >= own_from else "previous_response_id"
        kind = item.get("type", "message")
        if kind == "message":
            _message(item, param, out, system, passthrough)
        elif kind == "function_call":
            name = _str(item, "name", param)
            if isinstance(item.get("namespace"), str):
                name = item["namespace"] + NAMESPACE_SEP + name
            call = ToolCall(_str(item, "call_id", param), name, _str(item, "arguments", param))
            _append(out, "assistant", call)
        elif kind == "function_call_output":
            _append(out, "user", _call_output(item, param))
        elif kind == "reasoning":
            _append(out, "assistant", _reasoning_part(item))
        elif passthrough:
            _append(out, "assistant", Opaque(WIRE, item))
        else:
            raise invalid_request(
                f"{param}: input items of type {kind!r} cannot be served by this gateway "
                "(messages, function_call, function_call_output and reasoning can); remove it",
                f"{param}.type",
            )
    return out


def _append(out: list[Message], role: str, part: Part) -> None:
    """Consecutive calls (and their outputs) join one assistant (user) turn, as the
    chat wires want."""
    if (
        out
        and out[-1].role == role
        and (role == "assistant" or isinstance(out[-1].parts[-1], ToolResult))
    ):
        out[-1].parts.append(part)
    else:
        out.append(Message(role, [part], plain=False))  # type: ignore[arg-type]


def _str(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid_request(f"{param}.{key} must be a string", f"{param}.{key}")
    return value


def _message(
    item: dict[str, Any], param: str, out: list[Message], system: list[Text], passthrough: bool
) -> None:
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "assistant", "system", "developer"):
        raise invalid_request(
            f"{param}.role must be user, assistant, system or developer", f"{param}.role"
        )
    if isinstance(content, str):
        parts: list[Part] = [Text(content)]
    elif isinstance(content, list):
        parts = [
            _lenient(lambda: _part(p, f"{param}.content[{j}]"), passthrough, Opaque(WIRE, p))
            for j, p in enumerate(content)
        ]
    else:
        raise invalid_request(
            f"{param}.content must be a string or a list of parts", f"{param}.content"
        )
    if role in ("system", "developer"):
        text = "".join(p.text for p in parts if isinstance(p, Text))
        if not out:
            system.append(Text(text))
        else:
            out.append(Message("system", [Text(text)]))
        return
    if (
        role == "assistant"
        and out
        and out[-1].role == "assistant"
        and not isinstance(out[-1].parts[-1], ToolCall)
    ):
        out[-1].parts.extend(parts)  # text after its reasoning item: one assistant turn
        return
    out.append(Message(role, parts, plain=isinstance(content, str)))


def _part(p: Any, param: str) -> Part:
    kind = p.get("type") if isinstance(p, dict) else None
    if kind in ("input_text", "output_text"):
        if not isinstance(p.get("text"), str):
            raise invalid_request(f"{param}.text must be a string", f"{param}.text")
        return Text(p["text"])
    if kind == "refusal":
        return Text(str(p.get("refusal", "")))
    if kind == "input_image":
        if p.get("file_id") or not isinstance(p.get("image_url"), str):
            raise invalid_request(
                f"{param}: an input_image needs image_url (a data: URL or an https URL); a "
                "file_id names OpenAI's file storage, which this gateway does not have",
                f"{param}.image_url",
            )
        return image_from_url(p["image_url"], f"{param}.image_url")
    if kind == "input_file":
        if not isinstance(p.get("file_data"), str):
            raise invalid_request(
                f"{param}: an input_file needs file_data (a data:application/pdf;base64 URL); "
                "file_id and file_url name storage this gateway cannot read",
                f"{param}.file_data",
            )
        file = {"filename": p.get("filename") or "document.pdf", "file_data": p["file_data"]}
        # chat's file part: every translator knows it
        return Opaque("openai", {"type": "file", "file": file})
    raise invalid_request(
        f"{param}: content parts of type {kind!r} cannot be served by this gateway "
        "(input_text, input_image, input_file and output_text can)",
        f"{param}.type",
    )


def _call_output(item: dict[str, Any], param: str) -> ToolResult:
    output = item.get("output")
    call_id = _str(item, "call_id", param)
    if isinstance(output, str):
        return ToolResult(call_id, [Text(output)])
    if not isinstance(output, list):
        raise invalid_request(
            f"{param}.output must be a string or a list of parts", f"{param}.output"
        )
    content: list[Text | Image] = []
    for j, p in enumerate(output):
        part = _part(p, f"{param}.output[{j}]")
        if not isinstance(part, Text | Image):
            raise invalid_request(
                f"{param}.output[{j}]: a function_call_output carries text and images only",
                f"{param}.output[{j}].type",
            )
        content.append(part)
    return ToolResult(call_id, content, plain=False)


def _reasoning_part(item: dict[str, Any]) -> Part:
    sealed = item.get("encrypted_content")
    if isinstance(sealed, str) and sealed.startswith(_REDACTED):
        return RedactedThinking(sealed[len(_REDACTED) :])
    texts = [s.get("text", "") for s in item.get("summary") or [] if isinstance(s, dict)]
    texts += [c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict)]
    return Thinking("\n\n".join(t for t in texts if t), sealed if isinstance(sealed, str) else None)


# A namespace's functions are flat tools upstream, named <namespace>__<name> (Anthropic's tool names
# allow no dots); the model's calls of them come back split, with their `namespace`.
NAMESPACE_SEP = "__"


def _tools(t: dict[str, Any], i: int, passthrough: bool = False) -> list[Tool]:
    # a hosted tool: the upstream runs it
    if passthrough and t.get("type") not in ("function", "namespace"):
        return [Tool(str(t.get("name") or t.get("type")), None, {}, extra={"type": t.get("type")})]
    if t.get("type") != "namespace":
        return [_tool(t, i)]
    ns = t.get("name")
    if not isinstance(ns, str) or not ns or not isinstance(t.get("tools"), list):
        raise invalid_request(
            f"tools[{i}]: a namespace needs a name and a list of tools", f"tools[{i}]"
        )
    inner = [_tool(u, i) for u in t["tools"]]
    for tool in inner:
        tool.name = ns + NAMESPACE_SEP + tool.name
    return inner


def namespaces(body: dict[str, Any]) -> frozenset[str]:
    tools = body.get("tools") or []
    return frozenset(
        t["name"] for t in tools if isinstance(t, dict) and t.get("type") == "namespace"
    )


def _tool(t: dict[str, Any], i: int) -> Tool:
    kind = t.get("type")
    if kind != "function":
        raise invalid_request(
            f"tools[{i}]: the {kind!r} tool is hosted by OpenAI and cannot be run by this "
            "gateway's upstreams; remove it or define a function tool",
            f"tools[{i}].type",
        )
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_request(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
    params = t.get("parameters") or {"type": "object", "properties": {}}
    return Tool(name, t.get("description"), params, strict=t.get("strict"))


def _tool_choice(choice: Any, parallel: bool | None) -> ToolChoice | None:
    disable = parallel is False
    if choice is None:
        return ToolChoice("auto", disable_parallel=True) if disable else None
    if isinstance(choice, str):
        return ToolChoice(
            {"none": "none", "auto": "auto", "required": "any"}[choice], None, disable
        )
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return ToolChoice("tool", choice["name"], disable)
    raise invalid_request(
        f"tool_choice of type {choice.get('type')!r} names a tool hosted by OpenAI; "
        "use auto, none, required or a function",
        "tool_choice",
    )


def _format(text: w.TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat("json_object")
    if fmt.schema_ is None:
        raise invalid_request("text.format json_schema needs schema", "text.format.schema")
    return ResponseFormat("json_schema", fmt.schema_, fmt.name, bool(fmt.strict))


def _reasoning(r: w.ReasoningConfig | None) -> Reasoning | None:
    if r is None or r.effort in (None, "none"):
        return None
    return Reasoning(_EFFORT[r.effort])  # type: ignore[arg-type]


# ---- canonical → client ----------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_json(u: Usage) -> dict[str, Any]:
    # Like chat's prompt_tokens, input_tokens include cached ones; canonical input_tokens do not.
    prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    body: dict[str, Any] = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": u.cache_read_input_tokens},
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": prompt + u.output_tokens,
    }
    if u.estimated:  # the gateway's count, not the upstream's (providers/usage.py)
        body[ESTIMATE_FIELD] = u.estimated
    return body


def envelope(
    opts: Options,
    resp_id: str,
    model: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None,
) -> dict[str, Any]:
    """The `response` object: the request's settings echoed, as the API does."""
    b = opts.body
    text = b.get("text") if isinstance(b.get("text"), dict) else {}
    reasoning = b.get("reasoning") if isinstance(b.get("reasoning"), dict) else {}
    return {
        "id": resp_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": b.get("instructions"),
        "max_output_tokens": b.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": b.get("parallel_tool_calls", True) is not False,
        "previous_response_id": opts.previous_response_id,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": opts.store,
        "temperature": b.get("temperature"),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": b.get("tool_choice") or "auto",
        "tools": b.get("tools") or [],
        "top_p": b.get("top_p"),
        "truncation": "disabled",
        "usage": usage_json(usage) if usage is not None else None,
        "user": b.get("user"),
        "metadata": b.get("metadata") or {},
    }


def _finished(body: dict[str, Any], stop: StopReason) -> dict[str, Any]:
    if stop in (StopReason.MAX_TOKENS, StopReason.CONTEXT_WINDOW_EXCEEDED):
        body["status"] = "incomplete"
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    elif stop is StopReason.REFUSAL:
        body["status"] = "incomplete"
        body["incomplete_details"] = {"reason": "content_filter"}
    return body


def response_json(resp: ChatResponse, model: str, opts: Options) -> dict[str, Any]:
    """The non-stream `response` object for a canonical response (a Responses upstream's
    own, renamed)."""
    if resp.raw is not None and resp.raw.wire == WIRE:
        body = resp.raw.items[0][1]
        body["model"] = model
        return body
    output: list[dict[str, Any]] = []
    for p in resp.content:
        if isinstance(p, Text):
            if output and output[-1]["type"] == "message":
                output[-1]["content"][0]["text"] += p.text
            else:
                output.append(_message_item(new_id("msg"), p.text, "completed"))
        elif isinstance(p, Thinking | RedactedThinking):
            output.append(_reasoning_item(new_id("rs"), p, opts))
        elif isinstance(p, ToolCall):
            output.append(opts.call_item(new_id("fc"), p.id, p.name, p.arguments, "completed"))
    body = envelope(
        opts,
        new_id("resp"),
        model,
        resp.created or int(time.time()),
        "completed",
        output,
        resp.usage,
    )
    return _finished(body, resp.stop_reason)


def unrendered(resp: ChatResponse) -> set[str]:
    """The blocks of a translated reply no output item holds (another wire's verbatim
    blocks), by name."""
    if resp.raw is not None and resp.raw.wire == WIRE:
        return set()
    return {f"output[].type={p.type}" for p in resp.content if isinstance(p, Opaque)}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text)]
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _reasoning_item(item_id: str, p: Thinking | RedactedThinking, opts: Options) -> dict[str, Any]:
    item: dict[str, Any] = {"id": item_id, "type": "reasoning", "summary": []}
    if isinstance(p, Thinking) and p.text:
        item["summary"] = [{"type": "summary_text", "text": p.text}]
    sealed = _REDACTED + p.data if isinstance(p, RedactedThinking) else p.signature
    if sealed and (opts.include_encrypted or opts.store):  # a stored item must replay whole
        item["encrypted_content"] = sealed
    return item


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


# ---- the stream ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Item:
    """An output item being streamed: its index in `output`, and what it has gathered so far."""

    output_index: int
    body: dict[str, Any]
    text: list[str] = field(default_factory=list)
    signature: str | None = None


class StreamEncoder:
    """Renders canonical events as Responses SSE events, numbered by `sequence_number`.

    Each canonical block becomes an output item: text a `message` with one `output_text` part,
    thinking a `reasoning` item with one summary part, a tool call a `function_call`.
    """

    def __init__(self, model: str, opts: Options, dropped: set[str] | None = None) -> None:
        self.model = model
        self.opts = opts
        # the exchange's: named again, complete, on a translated stream's final event
        self.dropped = dropped
        self.id = new_id("resp")
        self.created = int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[int, _Item] = {}
        self.final: dict[str, Any] | None = None
        self._closing: list[bytes] = []

    def encode(self, ev: Event) -> Iterator[bytes]:
        raw = ev.raw if not isinstance(ev, Error) else None
        if raw is not None and (raw is SAME_RAW or raw.wire == WIRE):
            yield from self._raw(raw)
        elif isinstance(ev, Start):
            head = self._response("in_progress", None)
            yield self._event("response.created", response=head)
            yield self._event("response.in_progress", response=head)
        elif isinstance(ev, TextDelta):
            yield from self._text(ev)
        elif isinstance(ev, ThinkingDelta):
            yield from self._thinking(ev)
        elif isinstance(ev, ToolCallStart):
            item = self._add(
                ev.index, self.opts.call_item(new_id("fc"), ev.id, ev.name, "", "in_progress")
            )
            yield self._event(
                "response.output_item.added", output_index=item.output_index, item=dict(item.body)
            )
        elif isinstance(ev, ToolArgsDelta):
            item = self.open[ev.index]
            item.text.append(ev.fragment)
            yield self._event(
                "response.function_call_arguments.delta",
                item_id=item.body["id"],
                output_index=item.output_index,
                delta=ev.fragment,
            )
        elif isinstance(ev, BlockStop):
            yield from self._close(ev.index)
        elif isinstance(ev, Finish):
            body = self.finish(ev)
            yield from self._closing
            self._closing = []
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            # Beside the response object, not in it: that object is what the store
            # keeps and returns.
            named = {fields.DROPPED_FIELD: ",".join(sorted(self.dropped))} if self.dropped else {}
            yield self._event(kind, response=body, **named)
        elif isinstance(ev, Error):
            yield from self.fail(ev.error)

    def finish(self, ev: Finish) -> dict[str, Any]:
        """The final response object (what a store keeps); the same on every call."""
        if self.final is None and ev.raw is not None and ev.raw.wire == WIRE:  # the upstream's own
            ends = [
                d["response"] for _, d in ev.raw.items if d.get("type") in _ENDS and "response" in d
            ]
            if ends:
                self.final = {**ends[-1], "model": self.model}
        if self.final is None:  # blocks still open close first: the object holds them whole
            self._closing = [b for index in list(self.open) for b in self._close(index)]
            self.final = _finished(self._response("completed", ev.usage), ev.stop_reason)
        return self.final

    def fail(self, err: GatewayError) -> Iterator[bytes]:
        body = self._response("failed", None)
        body["error"] = {"code": err.code or "server_error", "message": err.message}
        yield self._event(
            "error",
            code=err.code or error_json(err)["error"]["type"],
            message=err.message,
            param=err.param,
        )
        yield self._event("response.failed", response=body)

    def _raw(self, raw: Raw) -> Iterator[bytes]:
        """A Responses upstream's events as they came, the model renamed; numbering goes
        on from theirs."""
        for name, data in raw.items:
            resp = data.get("response")
            if isinstance(resp, dict):
                resp["model"] = self.model
                self.id = resp.get("id", self.id)
            if isinstance(data.get("sequence_number"), int):
                self.seq = data["sequence_number"] + 1
            kind = name or str(data.get("type", ""))
            yield b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _response(self, status: str, usage: Usage | None) -> dict[str, Any]:
        return envelope(
            self.opts, self.id, self.model, self.created, status, list(self.output), usage
        )

    def _event(self, kind: str, **body: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **body}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _add(self, index: int, body: dict[str, Any]) -> _Item:
        item = self.open[index] = _Item(len(self.output), body)
        self.output.append(body)
        return item

    def _text(self, ev: TextDelta) -> Iterator[bytes]:
        item = self.open.get(ev.index)
        if item is None:
            item = self._add(ev.index, _message_item(new_id("msg"), None, "in_progress"))
            yield self._event(
                "response.output_item.added", output_index=item.output_index, item=_copy(item.body)
            )
            yield self._event(
                "response.content_part.added",
                item_id=item.body["id"],
                output_index=item.output_index,
                content_index=0,
                part=_output_text(""),
            )
        item.text.append(ev.text)
        yield self._event(
            "response.output_text.delta",
            item_id=item.body["id"],
            output_index=item.output_index,
            content_index=0,
            delta=ev.text,
            logprobs=[],
        )

    def _thinking(self, ev: ThinkingDelta) -> Iterator[bytes]:
        item = self.open.get(ev.index)
        if item is None:
            item = self._add(ev.index, {"id": new_id("rs"), "type": "reasoning", "summary": []})
            yield self._event(
                "response.output_item.added", output_index=item.output_index, item=_copy(item.body)
            )
            yield self._event(
                "response.reasoning_summary_part.added",
                item_id=item.body["id"],
                output_index=item.output_index,
                summary_index=0,
                part={"type": "summary_text", "text": ""},
            )
        if ev.signature:
            item.signature = ev.signature
        if ev.text:
            item.text.append(ev.text)
            yield self._event(
                "response.reasoning_summary_text.delta",
                item_id=item.body["id"],
                output_index=item.output_index,
                summary_index=0,
                delta=ev.text,
            )

    def _close(self, index: int) -> Iterator[bytes]:
        item = self.open.pop(index, None)
        if item is None:
            return
        body, text, at = item.body, "".join(item.text), item.output_index
        if body["type"] == "message":
            yield self._event(
                "response.output_text.done",
                item_id=body["id"],
                output_index=at,
                content_index=0,
                text=text,
                logprobs=[],
            )
            part = _output_text(text)
            yield self._event(
                "response.content_part.done",
                item_id=body["id"],
                output_index=at,
                content_index=0,
                part=part,
            )
            body.update(content=[part], status="completed")
        elif body["type"] == "reasoning":
            yield self._event(
                "response.reasoning_summary_text.done",
                item_id=body["id"],
                output_index=at,
                summary_index=0,
                text=text,
            )
            part = {"type": "summary_text", "text": text}
            yield self._event(
                "response.reasoning_summary_part.done",
                item_id=body["id"],
                output_index=at,
                summary_index=0,
                part=part,
            )
            body.update(_reasoning_item(body["id"], Thinking(text, item.signature), self.opts))
        else:
            yield self._event(
                "response.function_call_arguments.done",
                item_id=body["id"],
                output_index=at,
                name=body["name"],
                arguments=text,
            )
            body.update(arguments=text, status="completed")
        yield self._event("response.output_item.done", output_index=at, item=_copy(body))


def _copy(body: dict[str, Any]) -> dict[str, Any]:
    return orjson.loads(orjson.dumps(body))  # an event's snapshot: the item goes on changing
