"""Ollama's native API: /api/chat with NDJSON streaming, /api/tags for discovery."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson

from flashstack.gateway.config import ModelConfig, UpstreamLimits
from flashstack.gateway.core import (
    BlockStop,
    ChatRequest,
    ChatResponse,
    ErrorKind,
    Event,
    Finish,
    GatewayError,
    Image,
    Message,
    Opaque,
    Start,
    StopReason,
    Text,
    TextDelta,
    ThinkingDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
    ToolResult,
    Usage,
    error_for_status,
    invalid_request,
)
from flashstack.gateway.providers import shape
from flashstack.gateway.providers.base import Health, collect, probe_health
from flashstack.gateway.providers.http import event_json, lines, make_client, open_stream, post_json
from flashstack.gateway.providers.upstream import Upstream
from flashstack.gateway.redact import Redactor


class OllamaProvider:
    """One Ollama server; a model name per deployment."""

    def __init__(
        self, cfg: ModelConfig, limits: UpstreamLimits | None = None, redact: Redactor | None = None
    ) -> None:
        self.cfg = cfg
        self.upstream = Upstream.of(cfg, limits, redact)
        # the deployment id: errors never name the upstream's address
        self.name = self.upstream.name
        self.client = make_client(cfg, {}, self.upstream)

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        body = request_json(request, self.cfg.model, stream=True)
        decoder = LineDecoder()
        up = self.upstream
        async with open_stream(self.client, "/api/chat", body, upstream_error) as resp:
            async for line in lines(resp, up):
                if line.strip():
                    for ev in up.decode(decoder.feed, _parse_line(line, up), what="a line"):
                        yield ev
        if not decoder.done:
            raise GatewayError(
                ErrorKind.UPSTREAM, f"upstream {up.name} ended the stream before done=true"
            )

    async def complete(self, request: ChatRequest) -> ChatResponse:
        body = request_json(request, self.cfg.model, stream=False)
        up = self.upstream
        line = shape.ollama_reply(
            await post_json(self.client, "/api/chat", body, upstream_error), up
        )
        if not line.get("done"):
            raise up.shape_error("a reply", "done is not true")
        return await collect(_events_of(up, line))

    async def list_models(self) -> list[str]:
        return shape.model_ids(
            await self.client.get_json("/api/tags"), self.upstream, "models", "name"
        )

    async def health(self) -> Health:
        return await probe_health(self.list_models)

    async def aclose(self) -> None:
        await self.client.aclose()


async def _events_of(up: Upstream, line: dict[str, Any]) -> AsyncIterator[Event]:
    for ev in up.decode(LineDecoder().feed, line, what="a reply"):
        yield ev


def _parse_line(line: bytes, up: Upstream) -> dict[str, Any]:
    obj = event_json(line, up, "a line")
    if "error" in obj:
        raise up.failure(GatewayError(ErrorKind.UPSTREAM, str(obj["error"])))
    return shape.ollama_reply(obj, up, "a line")


def upstream_error(status: int, body: Any, retry_after: float | None = None) -> GatewayError:
    message = body.get("error") if isinstance(body, dict) else str(body)[:500]
    return error_for_status(status, str(message or f"ollama returned HTTP {status}"), retry_after)


# ---- canonical → Ollama ----------------------------------------------------------------------


def request_json(req: ChatRequest, model: str, stream: bool) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": req.system_text()})
    for m in req.messages:
        messages.extend(_message_json(m))
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": stream}
    options: dict[str, Any] = {}
    for src, dst in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("max_tokens", "num_predict"),
    ):
        if getattr(req, src) is not None:
            options[dst] = getattr(req, src)
    if req.stop:
        options["stop"] = req.stop
    if options:
        body["options"] = options
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.parameters,
                },
            }
            for t in req.tools
        ]
    rf = req.response_format
    if rf is not None:
        body["format"] = rf.schema if rf.type == "json_schema" and rf.schema else "json"
    return body


def _message_json(m: Message) -> Iterator[dict[str, Any]]:
    for p in m.parts:
        if isinstance(p, Opaque):  # a document, a server tool's block: nothing Ollama can read
            raise invalid_request(
                f"messages[].content[].type={p.type} cannot be sent to an Ollama model; "
                "remove it or choose a model served over the API it came from",
                "messages",
            )
    text = "".join(p.text for p in m.parts if isinstance(p, Text))
    if m.role == "system":  # an instruction mid-conversation, where it stands
        yield {"role": "system", "content": text}
        return
    if m.role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [p for p in m.parts if isinstance(p, ToolCall)]
        if calls:
            msg["tool_calls"] = [
                {"function": {"name": c.name, "arguments": _args(c)}} for c in calls
            ]
        yield msg
        return
    for p in m.parts:
        if isinstance(p, ToolResult):
            content = "".join(c.text for c in p.content if isinstance(c, Text))
            yield {"role": "tool", "content": content}
    images = [_image_data(p) for p in m.parts if isinstance(p, Image)]
    if text or images:
        msg = {"role": "user", "content": text}
        if images:
            msg["images"] = images
        yield msg


def _args(c: ToolCall) -> Any:
    try:
        return orjson.loads(c.arguments or "{}")
    except orjson.JSONDecodeError:
        raise invalid_request(
            f"arguments of tool call {c.id!r} are not valid JSON", "messages"
        ) from None


def _image_data(p: Image) -> str:
    if p.data is None:
        raise invalid_request(
            "Ollama takes images by value only: send them base64-encoded, not by URL"
        )
    return p.data


# ---- Ollama → canonical ----------------------------------------------------------------------


class LineDecoder:
    """Turns /api/chat NDJSON lines into canonical events."""

    def __init__(self) -> None:
        self.started = False
        self.done = False
        self.next_index = 0
        self.text_index: int | None = None
        self.thinking_index: int | None = None
        self.open: list[int] = []
        self.saw_tool = False

    def feed(self, line: dict[str, Any]) -> Iterator[Event]:
        if not self.started:
            self.started = True
            yield Start("msg_" + uuid.uuid4().hex[:24], line.get("model", ""))
        msg = line.get("message") or {}
        if msg.get("thinking"):
            if self.thinking_index is None:
                self.thinking_index = self._open()
            yield ThinkingDelta(self.thinking_index, msg["thinking"])
        if msg.get("content"):
            if self.text_index is None:
                self.text_index = self._open()
            yield TextDelta(self.text_index, msg["content"])
        for call in msg.get("tool_calls") or []:
            yield from self._tool_call(call)
        if line.get("done"):
            yield from self._finish(line)

    def _open(self) -> int:
        idx = self.next_index
        self.next_index += 1
        self.open.append(idx)
        return idx

    def _tool_call(self, call: dict[str, Any]) -> Iterator[Event]:
        # Ollama sends each tool call whole; it becomes a start plus one argument fragment.
        self.saw_tool = True
        self.text_index = None
        fn = call.get("function") or {}
        idx = self._open()
        yield ToolCallStart(
            idx, call.get("id") or "call_" + uuid.uuid4().hex[:24], fn.get("name", "")
        )
        args = fn.get("arguments")
        yield ToolArgsDelta(
            idx, args if isinstance(args, str) else orjson.dumps(args or {}).decode()
        )

    def _finish(self, line: dict[str, Any]) -> Iterator[Event]:
        self.done = True
        for idx in self.open:
            yield BlockStop(idx)
        reason = line.get("done_reason") or "stop"
        if reason == "length":
            stop = StopReason.MAX_TOKENS
        elif self.saw_tool:
            stop = StopReason.TOOL_USE
        else:
            stop = StopReason.END_TURN
        usage = Usage(line.get("prompt_eval_count") or 0, line.get("eval_count") or 0)
        yield Finish(stop, usage)
