"""An upstream that attacks the gateway: it echoes credentials, refuses them, floods, and lies about
shapes.

It speaks the OpenAI (`/v1/chat/completions`), Anthropic (`/v1/messages`) and Ollama (`/api/chat`,
NDJSON streams) wires, and does
what the last user text asks with `[[hostile:MODE]]` or `[[hostile:MODE:BYTES]]`; without one it
answers normally ("echo: <text>"), so the same gateway proves it still works after each attack.

    echo_401, echo_403    refuse the credential, quoting it back (and the URL with its query)
    echo_400, echo_500    the same quote in a 400 / 500, padded to 40 KB
    big_body:N            200 with a JSON body of N bytes, chunked (no content-length)
    big_declared:N        200 that declares content-length N (and sends that many bytes)
    big_error:N           500 with an N-byte body
    giant_line:N          200 event stream whose first line is N bytes long, never ended
    giant_event:N         200 event stream: one event of N bytes of short data lines
    empty_json            200 `{}`; streamed: events of `{}`, then the end marker
    wrong_shape           200 with fields of the wrong types; streamed: a chunk/event of the wrong
shape
    late_echo             streamed: one token, then an in-stream error quoting the credential
    late_giant_line:N     streamed: one token, then an N-byte line

`app.state.sent` records the bytes each flood really sent (by mode), `app.state.credentials` what
each request carried. `require` (header name → value) and `require_query` make every request
without those credentials a 401, as a real upstream would.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

DIRECTIVE = re.compile(r"\[\[hostile:(\w+)(?::(\d+))?\]\]")
PIECE = 64 * 1024


def create_app(
    require: dict[str, str] | None = None, require_query: dict[str, str] | None = None
) -> Starlette:
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", _openai, methods=["POST"]),
            Route("/v1/messages", _anthropic, methods=["POST"]),
            Route("/v1/models", _models, methods=["GET"]),
            Route("/api/chat", _ollama, methods=["POST"]),
            Route("/api/tags", _tags, methods=["GET"]),
        ]
    )
    app.state.sent = {}
    app.state.credentials = []
    app.state.require = {k.lower(): v for k, v in (require or {}).items()}
    app.state.require_query = require_query or {}
    return app


async def _models(request: Request) -> Response:
    if not _authorized(request):
        return _error("openai", 401, f"bad credentials: {_quote(request)}")
    return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})


async def _tags(request: Request) -> Response:
    return JSONResponse({"models": [{"name": "m", "model": "m"}]})


async def _ollama(request: Request) -> Response:
    return await _serve(request, "ollama")


async def _openai(request: Request) -> Response:
    return await _serve(request, "openai")


async def _anthropic(request: Request) -> Response:
    return await _serve(request, "anthropic")


async def _serve(request: Request, wire: str) -> Response:
    body = await request.json()
    quote = _quote(request)
    request.app.state.credentials.append(quote)
    if not _authorized(request):
        return _error(wire, 401, f"bad credentials: {quote}")
    mode, size = _directive(body, wire)
    stream = bool(body.get("stream"))
    if mode in ("echo_401", "echo_403"):
        return _error(wire, int(mode[-3:]), f"Incorrect API key provided: {quote}")
    if mode in ("echo_400", "echo_500"):
        return _error(wire, int(mode[-3:]), f"failed for {quote}; " + "padding " * 5_000)
    if mode == "big_body":
        return StreamingResponse(
            _counted(request, _json_flood(size), mode), media_type="application/json"
        )
    if mode == "big_declared":
        return StreamingResponse(
            _counted(request, _json_flood(size), mode),
            media_type="application/json",
            headers={"content-length": str(size)},
        )
    if mode == "big_error":
        return StreamingResponse(
            _counted(request, _json_flood(size), mode),
            status_code=500,
            media_type="application/json",
        )
    if mode == "giant_line":
        return _sse(_counted(request, _giant_line(size), mode))
    if mode == "giant_event":
        return _sse(_counted(request, _giant_event(size), mode))
    if mode == "empty_json":
        return _sse(_chunks(_empty_stream(wire))) if stream else JSONResponse({})
    if mode == "wrong_shape":
        return _sse(_chunks(_wrong_stream(wire))) if stream else JSONResponse(_wrong_body(wire))
    if mode == "late_echo":
        return _sse(_chunks([*_normal_stream(wire, "first", end=False), _late_error(wire, quote)]))
    if mode == "late_giant_line":
        head = [*_normal_stream(wire, "first", end=False)]
        return _sse(_counted(request, _then(head, _giant_line(size)), mode))
    text = "echo: " + _last_text(body)
    return (
        _sse(_chunks(_normal_stream(wire, text)))
        if stream
        else JSONResponse(_normal_body(wire, text))
    )


def _quote(request: Request) -> str:
    """Everything secret the request carried, as a careless upstream would print it."""
    auth = request.headers.get("authorization", "")
    said = [
        f"authorization={auth}",
        f"x-api-key={request.headers.get('x-api-key', '')}",
        f"url={request.url}",
    ]
    if auth.lower().startswith("basic "):
        said.append("basic=" + base64.b64decode(auth[6:]).decode(errors="replace"))
    return " ".join(said)


def _authorized(request: Request) -> bool:
    state = request.app.state
    return all(request.headers.get(k) == v for k, v in state.require.items()) and all(
        request.query_params.get(k) == v for k, v in state.require_query.items()
    )


def _directive(body: dict[str, Any], wire: str) -> tuple[str, int]:
    m = DIRECTIVE.search(_last_text(body))
    return (m.group(1), int(m.group(2) or 0)) if m else ("normal", 0)


def _last_text(body: dict[str, Any]) -> str:
    content = body["messages"][-1]["content"]
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def _error(wire: str, status: int, message: str) -> Response:
    if wire == "ollama":
        return JSONResponse({"error": message}, status)
    if wire == "openai":
        return JSONResponse(
            {"error": {"message": message, "type": "invalid_request_error", "code": None}}, status
        )
    kind = {401: "authentication_error", 403: "permission_error", 400: "invalid_request_error"}.get(
        status, "api_error"
    )
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status)


async def _counted(request: Request, pieces: Iterator[bytes], mode: str) -> AsyncIterator[bytes]:
    """Yield `pieces` until the gateway hangs up, adding each one's size to sent[mode].

    uvicorn drops writes to a closed connection silently; without the check the generator would
    run to its end and count bytes that never left.
    """
    sent = request.app.state.sent
    sent[mode] = 0
    for piece in pieces:
        if await request.is_disconnected():
            return
        yield piece
        sent[mode] += len(piece)


def _json_flood(size: int) -> Iterator[bytes]:
    yield b'{"pad": "'
    for _ in range(max(0, size - 11) // PIECE):
        yield b"x" * PIECE
    yield b'"}'


def _giant_line(size: int) -> Iterator[bytes]:
    yield b"data: "
    for _ in range(size // PIECE):
        yield b"y" * PIECE


def _giant_event(size: int) -> Iterator[bytes]:
    line = b"data: " + b"z" * 1000 + b"\n"
    for _ in range(size // (len(line) * 64)):
        yield line * 64


def _then(head: list[bytes], rest: Iterator[bytes]) -> Iterator[bytes]:
    yield b"".join(head)
    yield from rest


def _sse(body: AsyncIterator[bytes]) -> Response:
    return StreamingResponse(body, media_type="text/event-stream")


async def _chunks(events: list[bytes]) -> AsyncIterator[bytes]:
    for ev in events:
        yield ev


def _event(data: Any, name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return (
        head + "data: " + (data if isinstance(data, str) else json.dumps(data)) + "\n\n"
    ).encode()


def _ollama_line(text: str, done: bool) -> dict[str, Any]:
    line = {
        "model": "m",
        "created_at": "2026-01-01T00:00:00Z",
        "message": {"role": "assistant", "content": text},
        "done": done,
    }
    return (
        {**line, "done_reason": "stop", "prompt_eval_count": 1, "eval_count": 2} if done else line
    )


def _ndjson(obj: Any) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def _normal_body(wire: str, text: str) -> dict[str, Any]:
    if wire == "ollama":
        return _ollama_line(text, True)
    if wire == "openai":
        return {
            "id": "chatcmpl-h",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        }
    return {
        "id": "msg_h",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 2},
    }


def _normal_stream(wire: str, text: str, end: bool = True) -> list[bytes]:
    if wire == "ollama":
        return [_ndjson(_ollama_line(text, False))] + (
            [_ndjson(_ollama_line("", True))] if end else []
        )
    if wire == "openai":
        chunk = {"id": "chatcmpl-h", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        events = [
            _event(
                {
                    **chunk,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}}],
                }
            )
        ]
        if end:
            events += [
                _event({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
                _event("[DONE]"),
            ]
        return events
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_h",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [],
            "usage": {"input_tokens": 1, "output_tokens": 0},
        },
    }
    events = [
        _event(start, "message_start"),
        _event(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            "content_block_start",
        ),
        _event(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": text},
            },
            "content_block_delta",
        ),
    ]
    if end:
        events += [
            _event({"type": "content_block_stop", "index": 0}, "content_block_stop"),
            _event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn"},
                    "usage": {"output_tokens": 2},
                },
                "message_delta",
            ),
            _event({"type": "message_stop"}, "message_stop"),
        ]
    return events


def _late_error(wire: str, quote: str) -> bytes:
    if wire == "ollama":
        return _ndjson({"error": f"upstream failed for {quote}"})
    if wire == "openai":
        return _event(
            {"error": {"message": f"upstream failed for {quote}", "type": "server_error"}}
        )
    return _event(
        {"type": "error", "error": {"type": "authentication_error", "message": f"key {quote}"}},
        "error",
    )


def _empty_stream(wire: str) -> list[bytes]:
    if wire == "ollama":
        return [b"{}\n", b"{}\n"]
    if wire == "openai":
        return [_event({}), _event({}), _event("[DONE]")]
    return [
        _event({}, "message_start"),
        _event({}, "content_block_delta"),
        _event({}, "message_stop"),
    ]


def _wrong_stream(wire: str) -> list[bytes]:
    if wire == "ollama":
        return [
            _ndjson({"model": "m", "message": {"role": "assistant", "content": 5}, "done": False})
        ]
    if wire == "openai":
        return [
            _event({"id": "c", "choices": [{"index": 0, "delta": "not an object"}]}),
            _event("[DONE]"),
        ]
    return [
        _event(
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x"}},
            "content_block_delta",
        )
    ]


def _wrong_body(wire: str) -> dict[str, Any]:
    if wire == "ollama":
        return {"model": "m", "message": "not an object", "done": True}
    if wire == "openai":
        return {
            "id": "c",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": ["not", "a string"]}}
            ],
        }
    return {"id": "m", "type": "message", "content": "not a list", "stop_reason": "end_turn"}
