"""A recording upstream of either wire that answers whatever the test set: a body, or SSE events.

    app = canned.create_app("openai")
    app.state.reply = canned.Reply(body={...}, events=[("", {...}), ...], headers={...})

Every request is recorded (tests/fakes/recording.py); the reply is sent as set, whatever was asked,
so a test controls every field the client gets back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from tests.fakes.recording import EventStream, init_state, record


@dataclass
class Reply:
    body: dict[str, Any] = field(default_factory=dict)  # the non-stream answer
    # (SSE event name or "", data)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 200  # of the non-stream answer
    done: bool = True  # OpenAI streams end with data: [DONE]


def _sse(events: list[tuple[str, dict[str, Any]]], done: bool) -> AsyncIterator[bytes]:
    async def body() -> AsyncIterator[bytes]:
        for name, data in events:
            head = b"event: " + name.encode() + b"\n" if name else b""
            yield head + b"data: " + orjson.dumps(data) + b"\n\n"
        if done:
            yield b"data: [DONE]\n\n"

    return body()


def _usage_as_asked(
    events: list[tuple[str, dict[str, Any]]], body: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """As OpenAI streams: usage (and the usage-only chunk) only with
    stream_options.include_usage."""
    if (body.get("stream_options") or {}).get("include_usage"):
        return events
    out = []
    for name, data in events:
        if not data.get("choices") and "usage" in data:
            continue
        out.append((name, {k: v for k, v in data.items() if k != "usage"}))
    return out


def create_app(wire: str) -> FastAPI:
    """A canned upstream of `wire` ("openai": /v1/chat/completions; "anthropic":
    /v1/messages[/count_tokens])."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    init_state(app)
    app.state.reply = Reply()

    async def answer(request: Request) -> Response:
        index, body = await record(request)
        reply: Reply = request.app.state.reply
        if isinstance(body, dict) and body.get("stream"):
            events = reply.events if wire != "openai" else _usage_as_asked(reply.events, body)
            return EventStream(
                _sse(events, reply.done and wire == "openai"),
                "text/event-stream",
                reply.headers,
                index,
                request.app.state.cancelled,
            )
        return Response(
            orjson.dumps(reply.body),
            reply.status,
            media_type="application/json",
            headers=reply.headers,
        )

    if wire == "openai":
        app.add_route("/v1/chat/completions", answer, methods=["POST"])
    else:
        app.add_route("/v1/messages", answer, methods=["POST"])
        app.add_route("/v1/messages/count_tokens", answer, methods=["POST"])
    return app
