"""The engine server's event streams, written straight to the ASGI server.

Starlette's StreamingResponse watches for the client leaving through an anyio task group: a cancel
scope, a task and its handle per stream, a quarter of the API process's CPU per admitted request
(docs/benchmarks.md, "Engine serving"). Here one plain asyncio task waits for the disconnect and
cancels the writer, which closes the body: the request's stream aborts in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.types import Receive, Scope, Send

_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class EventStreamResponse:
    """An SSE response (ASGI app) over `chunks`; the stream ends early when the client leaves."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.current_task()
        assert writer is not None
        left = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            left.set()
            writer.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            watcher.cancel()  # the response is complete: its own disconnect must not cancel us
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left.is_set():
                raise  # not the client leaving: a shutdown, say
            writer.uncancel()
        finally:
            watcher.cancel()
            await self.chunks.aclose()  # aborts the request in the engine when it had not ended
