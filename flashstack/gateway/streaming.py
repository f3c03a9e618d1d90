"""Server-sent events out, with a bounded queue between the upstream reader and the client writer.

The queue is the backpressure: when the client reads slowly its socket fills, uvicorn's `send`
waits, the writer stops taking from the queue, the full queue stops the reader, and the reader
stops reading the upstream. Memory stays bounded by the queue size, whatever the upstream sends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass

from flashstack.gateway.core import Error, ErrorKind, Event, GatewayError

log = logging.getLogger("flashstack.gateway")

_END = object()
_QUIET = object()  # the upstream said nothing for a heartbeat interval
# Readers still closing their upstream after the client left; held so the loop cannot drop them.
_closing: set[asyncio.Task[None]] = set()


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
        await queue.put(Error(GatewayError(ErrorKind.INTERNAL, "the upstream stream failed unexpectedly")))
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
    """The SSE body for `events`, rendered by `encode`; `ping` is sent while the upstream is quiet."""
    stream = bounded(events, maxsize, ping_interval if ping is not None else None)
    try:
        async for ev in stream:
            if ev is None:
                yield ping  # type: ignore[misc]
                continue
            for chunk in encode(ev):
                yield chunk
    finally:
        await stream.aclose()
