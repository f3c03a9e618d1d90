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

from flashstack.gateway.core import Error, ErrorKind, Event, GatewayError

log = logging.getLogger("flashstack.gateway")

_END = object()
# Readers still closing their upstream after the client left; held so the loop cannot drop them.
_closing: set[asyncio.Task[None]] = set()


async def bounded(events: AsyncIterator[Event], maxsize: int) -> AsyncIterator[Event]:
    """Re-yield `events` through a queue of `maxsize`; a failure becomes a final Error event.

    Closing this iterator (the client went away) cancels the reader, which closes the upstream
    request at once.
    """
    queue: asyncio.Queue[object] = asyncio.Queue(maxsize)
    reader = asyncio.create_task(_read(events, queue))
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            yield item  # type: ignore[misc]
            if isinstance(item, Error):
                return
    finally:
        reader.cancel()
        _closing.add(reader)
        reader.add_done_callback(_closing.discard)
        # Shielded: if this task is being cancelled, awaiting the reader directly would cancel it a
        # second time and interrupt the upstream connection's own (shielded) close.
        with suppress(asyncio.CancelledError):
            await asyncio.shield(reader)


async def _read(events: AsyncIterator[Event], queue: asyncio.Queue[object]) -> None:
    try:
        async for ev in events:
            await queue.put(ev)
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
    stream = bounded(events, maxsize)
    try:
        while True:
            try:
                if ping is None:
                    ev = await anext(stream)
                else:
                    ev = await asyncio.wait_for(anext(stream), ping_interval)
            except StopAsyncIteration:
                return
            except TimeoutError:
                yield ping  # type: ignore[misc]
                continue
            for chunk in encode(ev):
                yield chunk
    finally:
        await stream.aclose()
