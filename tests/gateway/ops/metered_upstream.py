"""An Anthropic- and OpenAI-shaped upstream whose usage the test sets: cache counters included.

Input and cache tokens come from `app.state.usage`; output tokens are the request's max_tokens (so
the gateway's budget bound, max_tokens of output, is exact). It records each request's headers.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def _sse(event: str | None, data: dict) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def create_app(
    input_tokens: int = 1000, cache_read: int = 0, cache_write: int = 0, delay: float = 0.0
) -> Starlette:
    async def messages(request: Request) -> Response:
        body = await request.json()
        request.app.state.headers.append(dict(request.headers))
        u = request.app.state.usage
        out = body.get("max_tokens") or 16
        await asyncio.sleep(request.app.state.delay)
        usage = {
            "input_tokens": u["input"],
            "output_tokens": out,
            "cache_read_input_tokens": u["cache_read"],
            "cache_creation_input_tokens": u["cache_write"],
        }
        msg_id = "msg_" + uuid.uuid4().hex[:20]
        if not body.get("stream"):
            return JSONResponse(
                {
                    "id": msg_id,
                    "type": "message",
                    "role": "assistant",
                    "model": body["model"],
                    "content": [{"type": "text", "text": "metered"}],
                    "stop_reason": "end_turn",
                    "stop_sequence": None,
                    "usage": usage,
                }
            )

        async def events() -> AsyncIterator[bytes]:
            start = {**usage, "output_tokens": 1}
            yield _sse(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": msg_id,
                        "type": "message",
                        "role": "assistant",
                        "model": body["model"],
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": start,
                    },
                },
            )
            yield _sse(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            )
            yield _sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "metered"},
                },
            )
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            yield _sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                    "usage": usage,
                },
            )
            yield _sse("message_stop", {"type": "message_stop"})

        return StreamingResponse(events(), media_type="text/event-stream")

    async def chat(request: Request) -> Response:
        body = await request.json()
        request.app.state.headers.append(dict(request.headers))
        u = request.app.state.usage
        out = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        await asyncio.sleep(request.app.state.delay)
        usage = {
            "prompt_tokens": u["input"] + u["cache_read"],
            "completion_tokens": out,
            "total_tokens": u["input"] + u["cache_read"] + out,
            "prompt_tokens_details": {"cached_tokens": u["cache_read"]},
        }
        base = {"id": "chatcmpl-" + uuid.uuid4().hex[:20], "created": 1, "model": body["model"]}
        if not body.get("stream"):
            return JSONResponse(
                {
                    **base,
                    "object": "chat.completion",
                    "usage": usage,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "metered"},
                        }
                    ],
                }
            )

        async def chunks() -> AsyncIterator[bytes]:
            chunk = {**base, "object": "chat.completion.chunk"}
            yield _sse(
                None,
                {
                    **chunk,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": "metered"},
                            "finish_reason": None,
                        }
                    ],
                },
            )
            yield _sse(
                None, {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            )
            yield _sse(None, {**chunk, "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def embeddings(request: Request) -> Response:
        body = await request.json()
        request.app.state.headers.append(dict(request.headers))
        n = request.app.state.usage["input"]
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        return JSONResponse(
            {
                "object": "list",
                "model": body["model"],
                "usage": {"prompt_tokens": n, "total_tokens": n},
                "data": [
                    {"object": "embedding", "index": i, "embedding": [0.5, -0.5]}
                    for i in range(len(texts))
                ],
            }
        )

    async def completions(request: Request) -> Response:
        """Legacy completions; streamed, the usage chunk only when asked for (as
        api.openai.com does)."""
        body = await request.json()
        request.app.state.headers.append(dict(request.headers))
        request.app.state.bodies.append(body)
        u = request.app.state.usage
        out = body.get("max_tokens") or 16
        usage = {
            "prompt_tokens": u["input"] + u["cache_read"],
            "completion_tokens": out,
            "total_tokens": u["input"] + u["cache_read"] + out,
            "prompt_tokens_details": {"cached_tokens": u["cache_read"]},
        }
        base = {
            "id": "cmpl-" + uuid.uuid4().hex[:20],
            "object": "text_completion",
            "created": 1,
            "model": body["model"],
        }
        if not body.get("stream"):
            return JSONResponse(
                {
                    **base,
                    "usage": usage,
                    "choices": [
                        {"index": 0, "text": "metered", "logprobs": None, "finish_reason": "length"}
                    ],
                }
            )
        with_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def chunks() -> AsyncIterator[bytes]:
            extra = {"usage": None} if with_usage else {}
            yield _sse(
                None,
                {
                    **base,
                    **extra,
                    "choices": [
                        {"index": 0, "text": "metered", "logprobs": None, "finish_reason": "length"}
                    ],
                },
            )
            if with_usage:
                yield _sse(None, {**base, "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [], "has_more": False})

    app = Starlette(
        routes=[
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models),
        ]
    )
    app.state.usage = {"input": input_tokens, "cache_read": cache_read, "cache_write": cache_write}
    app.state.delay = delay
    app.state.headers = []
    app.state.bodies = []  # legacy completions' bodies, as received
    return app
