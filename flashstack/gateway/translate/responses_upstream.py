"""An upstream that serves the Responses API itself (`responses_api: true`): a Responses client's
body goes to it whole, and its reply (body or events) comes back whole, through the canonical
types only for what the gateway reads (usage, stop reason, text for format checks and stores)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flashstack.gateway.core import (
    BlockStop,
    ChatRequest,
    ChatResponse,
    ErrorKind,
    Event,
    Finish,
    GatewayError,
    Part,
    Raw,
    Start,
    StopReason,
    Text,
    TextDelta,
    Thinking,
    ThinkingDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
    Usage,
)
from flashstack.gateway.translate.raw import RawTap

WIRE = "responses"


def request_json(req: ChatRequest, upstream_model: str, stream: bool) -> dict[str, Any]:
    """The client's body as sent (`req.extra`), the model renamed and `stream` as the call needs."""
    body = {**req.extra, "model": upstream_model}
    if stream:
        body["stream"] = True
    else:
        body.pop("stream", None)
    return body


def usage_from_json(u: dict[str, Any] | None) -> Usage:
    if not u:
        return Usage()
    cached = (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (u.get("output_tokens_details") or {}).get("reasoning_tokens") or 0
    return Usage(
        max(0, (u.get("input_tokens") or 0) - cached),
        u.get("output_tokens") or 0,
        cached,
        0,
        reasoning,
    )


def stop_reason(body: dict[str, Any], has_calls: bool) -> StopReason:
    if body.get("status") == "incomplete":
        reason = (body.get("incomplete_details") or {}).get("reason")
        return StopReason.REFUSAL if reason == "content_filter" else StopReason.MAX_TOKENS
    return StopReason.TOOL_USE if has_calls else StopReason.END_TURN


def response_from_json(body: dict[str, Any]) -> ChatResponse:
    """The canonical response for a Responses upstream's body, kept whole for the client."""
    content: list[Part] = []
    for item in body.get("output") or []:
        kind = item.get("type")
        if kind == "message":
            text = "".join(
                c.get("text", "")
                for c in item.get("content") or []
                if c.get("type") == "output_text"
            )
            content.append(Text(text))
        elif kind == "function_call":
            content.append(
                ToolCall(item.get("call_id", ""), item.get("name", ""), item.get("arguments", ""))
            )
        elif kind == "reasoning":
            summary = "".join(s.get("text", "") for s in item.get("summary") or [])
            content.append(Thinking(summary, item.get("encrypted_content")))
    has_calls = any(isinstance(p, ToolCall) for p in content)
    return ChatResponse(
        id=body.get("id", ""),
        model=body.get("model", ""),
        content=content,
        stop_reason=stop_reason(body, has_calls),
        usage=usage_from_json(body.get("usage")),
        created=int(body.get("created_at") or 0),
        raw=Raw(WIRE, [("", body)]),
    )


def failure(data: dict[str, Any]) -> GatewayError:
    err = data.get("error") or (data.get("response") or {}).get("error") or data
    message = err.get("message") if isinstance(err, dict) else None
    return GatewayError(ErrorKind.UPSTREAM, f"the upstream's response failed: {message or err}")


class EventDecoder:
    """A Responses upstream's events → canonical events, each carrying the events it came from."""

    def __init__(self) -> None:
        self.tap = RawTap(WIRE)
        self.blocks: dict[int, int] = {}  # output_index → canonical block index
        self.calls = False

    def feed(self, name: str, data: dict[str, Any]) -> Iterator[Event]:
        self.tap.add(name, data)
        for ev in self._events(data):
            ev.raw = self.tap.take()
            yield ev

    def _events(self, data: dict[str, Any]) -> Iterator[Event]:
        kind = data.get("type", "")
        at = data.get("output_index")
        if kind == "response.created":
            resp = data.get("response") or {}
            yield Start(resp.get("id", ""), resp.get("model", ""))
        elif (
            kind == "response.output_item.added"
            and (data.get("item") or {}).get("type") == "function_call"
        ):
            item = data["item"]
            self.calls = True
            yield ToolCallStart(self._open(at), item.get("call_id", ""), item.get("name", ""))
        elif kind == "response.output_text.delta":
            yield TextDelta(self._block(at), data.get("delta", ""))
        elif kind == "response.reasoning_summary_text.delta":
            yield ThinkingDelta(self._block(at), data.get("delta", ""))
        elif kind == "response.function_call_arguments.delta":
            yield ToolArgsDelta(self._block(at), data.get("delta", ""))
        elif kind == "response.output_item.done" and at in self.blocks:
            yield BlockStop(self.blocks.pop(at))
        elif kind in ("response.completed", "response.incomplete"):
            body = data.get("response") or {}
            yield Finish(stop_reason(body, self.calls), usage_from_json(body.get("usage")))
        elif kind in ("response.failed", "error"):
            raise failure(data)

    def _open(self, output_index: Any) -> int:
        # A block per output item, indexed as the item is: indexes stay unique and in order.
        idx = self.blocks[output_index] = int(output_index or 0)
        return idx

    def _block(self, output_index: Any) -> int:
        return (
            self.blocks[output_index] if output_index in self.blocks else self._open(output_index)
        )
