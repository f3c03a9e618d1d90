"""The engine server's edge: the API-key check, the body cap, draining on SIGTERM, and the
generation routes' direct dispatch."""

from __future__ import annotations

import asyncio
import hmac
import signal
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashstack.engine.sse import ClientWatch
from flashstack.gateway.content_encoding import read_body
from flashstack.gateway.core import GatewayError
from flashstack.gateway.wire.openai import error_body, error_json

BODY_LIMIT = "flashstack engine serve --max-body-bytes"  # what a 413 tells the user to raise

# Open to anyone, as in vLLM: probes and scrapers carry no API key.
_PUBLIC_PATHS = frozenset({"/health", "/metrics"})


class ServeOptions(BaseModel):
    """`flashstack engine serve` switches that belong to the HTTP server, not the engine."""

    # The first is the name responses report; empty: the model file's or directory's name.
    served_model_names: list[str] = Field(default_factory=list)
    api_key: str | None = None  # None: no key required
    drain_timeout_s: float = Field(30.0, ge=0)  # after SIGTERM, how long running requests may take
    # One log line per request; off by default, as the gateway: it costs the event loop CPU.
    access_log: bool = False
    # A POST's body, decoded; larger → 413 unread. 128k tokens of text are ~0.5 MB.
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)


class Drain:
    """Requests in flight; once draining, new ones are refused and shutdown awaits the rest."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.in_flight = 0
        self.started_at: float | None = None

    @property
    def draining(self) -> bool:
        """True after SIGTERM."""
        return self.started_at is not None

    def start(self) -> None:
        """Refuse new requests from now on."""
        if self.started_at is None:
            self.started_at = time.monotonic()

    def finished(self) -> bool:
        """True once draining and nothing is left running (or the timeout passed)."""
        if self.started_at is None:
            return False
        return self.in_flight == 0 or time.monotonic() - self.started_at > self.timeout_s


def _error(status: int, message: str, type_: str, code: str) -> tuple[int, bytes]:
    return status, orjson.dumps(error_body(message, type_, code=code))


class EdgeMiddleware:
    """401 without the key, 503 while draining; pure ASGI, so streamed responses pass untouched.
    With `max_body_bytes`, a POST's body is read here under that cap (413 past it) and handed on
    whole."""

    def __init__(
        self, app: Any, drain: Drain, api_key: str | None, max_body_bytes: int | None = None
    ) -> None:
        self.app, self.drain, self.api_key = app, drain, api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        refusal = self._refusal(path, dict(scope["headers"]))
        if refusal is not None:
            return await _send_json(send, *refusal)
        if self.max_body_bytes is not None and scope["method"] == "POST":
            try:
                body = await read_body(Request(scope, receive), self.max_body_bytes, BODY_LIMIT)
            except ClientDisconnect:
                return  # gone before its request was whole: nothing was started
            except GatewayError as exc:  # too large, or an encoding it cannot decode
                return await _send_json(send, exc.status, orjson.dumps(error_json(exc)))
            receive = _replaying(body, receive)
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> tuple[int, bytes] | None:
        if self.drain.draining and path != "/metrics":
            message = "the server is shutting down; retry on another replica"
            return _error(503, message, "service_unavailable", "shutting_down")
        if self.api_key is None or path in _PUBLIC_PATHS:
            return None
        auth = headers.get(b"authorization", b"").decode("latin-1")
        token = auth[7:] if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            return _error(
                401,
                "incorrect or missing API key: send the server's --api-key as "
                "'Authorization: Bearer <key>'",
                "invalid_request_error",
                "invalid_api_key",
            )
        return None


def _replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` with the body, already read and decoded, as its first message."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


async def _send_json(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


PostRoute = Callable[[bytes], Awaitable[ASGIApp]]  # the request's body in, its response out


class EngineApp(FastAPI):
    """FastAPI, except that POSTs to the generation routes skip its middleware stack, dependency
    solving and route table, as the gateway's chat routes do: they parse their own body and turn
    every failure into a response. That machinery cost more API-process CPU per request than
    the request's own work (docs/benchmarks.md, "Engine serving")."""

    def set_fast_routes(self, routes: dict[str, PostRoute], options: ServeOptions, drain: Drain):
        """Serve POSTs to these paths through `routes`, behind the same API-key and drain edge."""
        self._fast_routes = routes
        self._fast_edge = EdgeMiddleware(
            self._dispatch_fast, drain, options.api_key, options.max_body_bytes
        )

    _fast_routes: dict[str, PostRoute] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            if scope["path"] in self._fast_routes:
                return await self._fast_edge(scope, receive, send)
        await super().__call__(scope, receive, send)

    async def _dispatch_fast(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = (await receive())["body"]  # the edge read it whole, under the body cap
        # From here a client that leaves cancels the request wherever it waits.
        watch = ClientWatch(receive, send)
        try:
            response = await self._fast_routes[scope["path"]](body)
            await response(scope, receive, watch.send)
        except asyncio.CancelledError:
            if not watch.left:
                raise  # not the client: a shutdown
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        finally:
            watch.stop()


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains (503 to new requests) before shutting down."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.drain.draining:
            self.drain.start()  # on_tick ends the main loop once the running requests are done
            return
        super().handle_exit(sig, frame)  # SIGINT, or a second SIGTERM: uvicorn's own shutdown

    async def on_tick(self, counter: int) -> bool:
        if self.drain.finished():
            self.should_exit = True
        return await super().on_tick(counter)
