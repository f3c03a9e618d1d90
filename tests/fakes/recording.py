"""What the fakes share below the protocol: request recording, paced chunks, a disconnect-aware
stream.

`app.state.requests` gets one `RecordedRequest` per request; `app.state.cancelled` gets
`(request_index, time.monotonic())` when a client leaves a stream before its end.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: Any  # parsed JSON, or None when absent or malformed
    raw: bytes


def init_state(app: Any) -> None:
    app.state.requests = []
    app.state.cancelled = []


async def record(request: Request) -> tuple[int, Any]:
    """Record `request` on its app; returns its index and its parsed JSON body (None if not
    JSON)."""
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = None
    log = request.app.state.requests
    log.append(RecordedRequest(request.method, request.url.path, dict(request.headers), body, raw))
    return len(log) - 1, body


async def paced(items: Iterable[str], interval: float) -> AsyncIterator[str]:
    """Yield `items`, sleeping `interval` seconds between them (0: yield to the loop now and
    then)."""
    for n, item in enumerate(items):
        if interval and n:
            await asyncio.sleep(interval)
        elif n % 64 == 63:
            await asyncio.sleep(0)
        yield item


class EventStream(Response):
    """A streaming ASGI response that notices a client disconnect at once, even between chunks.

    Starlette's StreamingResponse only listens for disconnects under ASGI spec < 2.4; this one
    always does, so a slow stream is cancelled (and recorded in `cancelled`) the moment the peer
    goes away.
    """

    def __init__(
        self,
        body: AsyncIterator[bytes],
        media_type: str,
        headers: dict[str, str],
        request_index: int,
        cancelled: list,
    ) -> None:
        # Deliberately not Response.__init__: this response has no fixed body.
        self.status_code, self.background = 200, None
        self.body_iterator, self.media_type, self.extra_headers = body, media_type, headers
        self.request_index, self.cancelled = request_index, cancelled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", self.media_type.encode())]
        headers += [(k.encode(), v.encode()) for k, v in self.extra_headers.items()]
        headers.append((b"cache-control", b"no-cache"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        finished = False

        async def watch_disconnect(scope_to_cancel: anyio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:
                self._mark_cancelled()
            scope_to_cancel.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(watch_disconnect, group.cancel_scope)
            try:
                async for chunk in self.body_iterator:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                finished = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the server reports a vanished client on send
                self._mark_cancelled()
            group.cancel_scope.cancel()

    def _mark_cancelled(self) -> None:
        if not any(i == self.request_index for i, _ in self.cancelled):
            self.cancelled.append((self.request_index, time.monotonic()))
