"""The one Provider protocol every upstream implements, in canonical types only."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import httpx

from flashstack.gateway.core import (
    BlockStop,
    ChatRequest,
    ChatResponse,
    Error,
    Event,
    Finish,
    GatewayError,
    Part,
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


@dataclass(slots=True)
class Health:
    ok: bool
    latency_ms: float | None = None
    detail: str = ""
    checked_at: float = field(default_factory=time.time)


@runtime_checkable
class Provider(Protocol):
    """An upstream that can run a canonical ChatRequest.

    `stream` raises GatewayError before its first event when the upstream refuses the request
    (the router may then fall back); after the first event it raises too, and the streaming layer
    turns that into an error event in the caller's format.
    """

    name: str

    def stream(self, request: ChatRequest) -> AsyncIterator[Event]: ...

    async def complete(self, request: ChatRequest) -> ChatResponse: ...

    async def health(self) -> Health: ...

    async def list_models(self) -> list[str]: ...

    async def aclose(self) -> None: ...


async def probe_health(list_models: Callable[[], Awaitable[list[str]]]) -> Health:
    """Health from one model-list call: ok with its latency, or the failure it met."""
    t0 = time.perf_counter()
    try:
        await list_models()
    except GatewayError as e:
        return Health(False, detail=e.message)
    # its text may hold the address: the type only
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return Health(False, detail=f"health probe failed ({type(e).__name__})")
    return Health(True, (time.perf_counter() - t0) * 1000)


async def collect(events: AsyncIterator[Event]) -> ChatResponse:
    """Fold a canonical event stream into the response it describes."""
    start: Start | None = None
    blocks: dict[int, Part] = {}
    finish: Finish | None = None
    async for ev in events:
        if isinstance(ev, Start):
            start = ev
        elif isinstance(ev, TextDelta):
            block = blocks.setdefault(ev.index, Text(""))
            assert isinstance(block, Text)
            block.text += ev.text
        elif isinstance(ev, ThinkingDelta):
            block = blocks.setdefault(ev.index, Thinking(""))
            assert isinstance(block, Thinking)
            block.text += ev.text
            block.signature = ev.signature or block.signature
        elif isinstance(ev, ToolCallStart):
            blocks[ev.index] = ToolCall(ev.id, ev.name, "")
        elif isinstance(ev, ToolArgsDelta):
            block = blocks[ev.index]
            assert isinstance(block, ToolCall)
            block.arguments += ev.fragment
        elif isinstance(ev, Finish):
            finish = ev
        elif isinstance(ev, Error):
            raise ev.error
        elif isinstance(ev, BlockStop):
            pass
    for block in blocks.values():
        if isinstance(block, ToolCall) and not block.arguments:
            block.arguments = "{}"
    usage = finish.usage if finish else (start.usage if start else Usage())
    return ChatResponse(
        id=start.id if start else "",
        model=start.model if start else "",
        content=[blocks[i] for i in sorted(blocks)],
        stop_reason=finish.stop_reason if finish else StopReason.END_TURN,
        usage=usage,
        stop_sequence=finish.stop_sequence if finish else None,
        created=int(time.time()),
    )


async def replay(response: ChatResponse) -> AsyncIterator[Event]:
    """The canonical event stream of a complete response (for providers without streaming)."""
    yield Start(response.id, response.model, Usage(input_tokens=response.usage.input_tokens))
    for i, part in enumerate(response.content):
        if isinstance(part, Text):
            yield TextDelta(i, part.text)
        elif isinstance(part, Thinking):
            yield ThinkingDelta(i, part.text, part.signature)
        elif isinstance(part, ToolCall):
            yield ToolCallStart(i, part.id, part.name)
            yield ToolArgsDelta(i, part.arguments)
        yield BlockStop(i)
    yield Finish(response.stop_reason, response.usage, response.stop_sequence)
