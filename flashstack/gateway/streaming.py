"""Server-sent events out, pulled from the upstream as the client takes them.

The client's socket is the backpressure: when the client reads slowly its socket fills, uvicorn's
`send` waits, the writer stops pulling events, and the upstream is not read. A wire that sends
keep-alives while the upstream is quiet (Anthropic's pings) needs a reader running beside the
writer; there a bounded queue between the two carries the backpressure instead. Either way memory
stays bounded, whatever the upstream sends: the providers cap each line and event they read
(router.upstream_limits.max_line_bytes, providers/http.py) and stop reading past it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from flashstack.gateway.core import Error, ErrorKind, Event, GatewayError, Start

log = logging.getLogger("flashstack.gateway")

_END = object()
_QUIET = object()  # the upstream said nothing for a heartbeat interval
# Upstream closes still running after the client left; held so the loop cannot drop them.
_closing: set[asyncio.Future[None]] = set()


@dataclass(slots=True)
class _Pulse:
    """When the reader last handed an event over (loop time)."""

    last: float


async def bounded(
    events: AsyncIterator[Event], maxsize: int, heartbeat: float | None = None
) -> AsyncIterator[Event | None]:
    """Re-yield `events` through a queue of `maxsize`; a failure becomes a final Error event.

    With `heartbeat`, None is yielded whenever the upstream has been silent that long (the caller
    sends a keep-alive). Closing this iterator (the client went away) cancels the reader, which
    closes the upstream request at once.
    """
    queue: asyncio.Queue[object] = asyncio.Queue(maxsize)
    pulse = _Pulse(asyncio.get_running_loop().time())
    reader = asyncio.create_task(_read(events, queue, pulse))
    beat = asyncio.create_task(_heartbeat(queue, pulse, heartbeat)) if heartbeat else None
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            yield None if item is _QUIET else item  # type: ignore[misc]
            if isinstance(item, Error):
                return
    finally:
        if beat is not None:
            beat.cancel()
        reader.cancel()
        _closing.add(reader)
        reader.add_done_callback(_closing.discard)
        # Shielded: if this task is being cancelled, awaiting the reader directly would cancel it a
        # second time and interrupt the upstream connection's own (shielded) close.
        with suppress(asyncio.CancelledError):
            await asyncio.shield(reader)


async def pulled(events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """Re-yield `events` in the writer's own task; a failure becomes a final Error event,
    as in `bounded`.

    No reader task and no queue: one task switch less per event, ~12 % of a stream's CPU
    (docs/benchmarks.md, "Gateway overhead").
    """
    finished = False
    try:
        try:
            async for ev in events:
                yield ev
                if isinstance(ev, Error):
                    break
            finished = True
        except GatewayError as e:
            yield Error(e)
        except Exception:
            log.exception("upstream stream failed")
            yield Error(GatewayError(ErrorKind.INTERNAL, "the upstream stream failed unexpectedly"))
    finally:
        await _close(events, finished)


async def _close(events: AsyncIterator[Event], finished: bool) -> None:
    close = getattr(events, "aclose", None)
    if close is None:
        return
    if finished:  # nothing left to interrupt
        with suppress(Exception):
            await close()
        return
    # The client left (this task is being cancelled, maybe again at each await): close the upstream
    # in a task of its own, held so the loop cannot drop it, that a second cancellation
    # cannot interrupt.
    closing = asyncio.ensure_future(_quietly(close()))
    _closing.add(closing)
    closing.add_done_callback(_closing.discard)
    with suppress(asyncio.CancelledError):
        await asyncio.shield(closing)


async def _quietly(aw: Awaitable[None]) -> None:
    with suppress(Exception):
        await aw


async def _heartbeat(queue: asyncio.Queue[object], pulse: _Pulse, interval: float) -> None:
    # A watcher instead of a timeout on each wait: a timed-out wait would cancel the read it
    # guards, and a timer per event would cost a task per event.
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(pulse.last + interval - loop.time())
        if loop.time() - pulse.last >= interval:
            if queue.empty():  # a client still reading buffered events needs no keep-alive
                queue.put_nowait(_QUIET)
            pulse.last = loop.time()


async def _read(events: AsyncIterator[Event], queue: asyncio.Queue[object], pulse: _Pulse) -> None:
    loop = asyncio.get_running_loop()
    try:
        async for ev in events:
            await queue.put(ev)
            pulse.last = loop.time()
        await queue.put(_END)
    except GatewayError as e:
        await queue.put(Error(e))
    except Exception:
        log.exception("upstream stream failed")
        await queue.put(
            Error(GatewayError(ErrorKind.INTERNAL, "the upstream stream failed unexpectedly"))
        )
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            with suppress(Exception):
                await close()


async def sse(
    events: AsyncIterator[Event],
    encode: Callable[[Event], Iterable[bytes]],
    maxsize: int,
    ping: bytes | None = None,
    ping_interval: float = 15.0,
) -> AsyncIterator[bytes]:
    """The SSE body for `events`, rendered by `encode`; `ping` is sent while the upstream is quiet.

    One write per event, and the stream's Start goes out together with the first token (the router
    hands over a stream only once that token is in): each write is a syscall and a wake-up of the
    client, and one less before the first token took ~0.08 ms off the time to it.
    """
    stream = pulled(events) if ping is None else bounded(events, maxsize, ping_interval)
    held = b""
    try:
        async for ev in stream:
            if ev is None:
                if held:  # a quiet upstream after the start: the start must still come first
                    yield held
                    held = b""
                yield ping  # type: ignore[misc]
                continue
            data = b"".join(encode(ev))
            if isinstance(ev, Start):
                held += data
                continue
            if held:
                data, held = held + data, b""
            if data:
                yield data
        if held:
            yield held
    finally:
        await stream.aclose()


class EventStream(StreamingResponse):
    """A StreamingResponse that writes its head and first chunk before it watches for
    the client leaving.

    The first chunk (with the router's first token) is ready when the response is created;
    Starlette's disconnect watch (a task group, and a task switch before the first byte) then costs
    the rest of the stream, not its time to first token. The watch itself is Starlette's, unchanged.
    """

    _head_sent = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self._head_sent = True
            try:
                start = {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
                await send(start)
                first = await anext(self.body_iterator, None)  # type: ignore[call-overload]
                if first is not None:
                    await send({"type": "http.response.body", "body": first, "more_body": True})
            except OSError:  # what Starlette makes of a send to a client that left (ASGI spec 2.4)
                raise ClientDisconnect() from None
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        if self._head_sent:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await super().stream_response(send)
