"""The engine server's event streams, and what happens when their client leaves.

Starlette's StreamingResponse watches for the client leaving through an anyio task group: a cancel
scope, a task and its handle per stream, a quarter of the API process's CPU per admitted request
(docs/benchmarks.md, "Engine serving"). Here `ClientWatch`, one plain asyncio task per request,
waits for the disconnect and cancels the request's handler, whatever it is waiting for (a queued
prompt's first token, a whole non-streamed answer, the next chunk): its engine stream aborts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from starlette.types import Message, Receive, Scope, Send

_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class EventStreamResponse:
    """An SSE response (ASGI app): `first`, then `chunks` (an already started generator, so that
    closing it always runs its cleanup), closed whether the stream ends, fails or is cancelled."""

    def __init__(self, first: bytes, chunks: AsyncGenerator[bytes, None]) -> None:
        self.first, self.chunks = first, chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.chunks.aclose()  # aborts the request in the engine when it had not ended


class ClientWatch:
    """Cancels the current task when the client disconnects, until the response's last message.

    Use `send` for the response: it stops the watch before the final body goes out, since the
    ASGI server reports every completed response as a disconnect.
    """

    def __init__(self, receive: Receive, send: Send) -> None:
        self._send = send
        self._handler = asyncio.current_task()
        self.left = False
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.left = True
        if self._handler is not None:
            self._handler.cancel()

    async def send(self, message: Message) -> None:
        """The ASGI send, the watch stopped first when this is the response's last message."""
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self._watcher.cancel()
        await self._send(message)

    def stop(self) -> None:
        """End the watch (the handler returned or failed)."""
        self._watcher.cancel()
