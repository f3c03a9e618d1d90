"""A fake Anthropic Messages API: `POST /v1/messages` (JSON and SSE) and `GET /v1/models`.

Renders `script.decide` in the wire format of api.anthropic.com as the `anthropic` SDK parses it.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from . import script
from .recording import EventStream, init_state, paced, record
from .script import BadRequest, Prompt, Reply

MODELS = ("claude-sonnet-4-5-20250929", "claude-haiku-4-5-20251001", "claude-opus-4-1-20250805")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ERROR_MESSAGES = {
    429: "Number of request tokens has exceeded your per-minute rate limit",
    529: "Overloaded",
}
SIGNATURE = "EqQBCkYIBxgCKkDfakesignature"


def request_id(index: int) -> str:
    return "req_011CV" + hashlib.sha256(str(index).encode()).hexdigest()[:20]


def error_response(status: int, message: str, index: int, headers: dict | None = None) -> Response:
    error_type = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = {
        "type": "error",
        "error": {"type": error_type, "message": message},
        "request_id": request_id(index),
    }
    return JSONResponse(body, status, headers={"request-id": request_id(index), **(headers or {})})


def check_headers(request: Request, api_key: str | None) -> tuple[int, str] | None:
    # The API takes a key as x-api-key or as a bearer token (the 2.x SDK sends the latter).
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    key = request.headers.get("x-api-key") or (bearer if scheme.lower() == "bearer" else "")
    if not key:
        return 401, "x-api-key header is required"
    if api_key is not None and key != api_key:
        return 401, "invalid x-api-key"
    if not request.headers.get("anthropic-version"):
        return 400, "anthropic-version: header is required"
    return None


def _text_of(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    return [
        b.get("text", "") for b in content or () if isinstance(b, dict) and b.get("type") == "text"
    ]


def to_prompt(body: Any) -> Prompt:
    """Validate the request as the real API does (the fields the fake reads) and reduce it."""
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    for name in ("model", "max_tokens", "messages"):
        if name not in body:
            raise BadRequest(f"{name}: Field required", name)
    if not isinstance(body["max_tokens"], int) or body["max_tokens"] < 1:
        raise BadRequest("max_tokens: Input should be a valid integer greater than 0", "max_tokens")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: at least one message is required", "messages")
    prompt = Prompt(max_tokens=body["max_tokens"], stop=tuple(body.get("stop_sequences") or ()))
    prompt.texts += _text_of(body.get("system"))
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise BadRequest(
                f"messages.{i}.role: Input should be 'user' or 'assistant'", "messages"
            )
        content = message.get("content")
        prompt.texts += _text_of(content)
        for block in content if isinstance(content, list) else ():
            if block.get("type") == "tool_result":
                prompt.texts += _text_of(block.get("content"))
    user_turns = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if user_turns:
        _read_last_user(prompt, messages[user_turns[-1]].get("content"), user_turns[-1])
    _read_tools(prompt, body)
    return prompt


def _read_last_user(prompt: Prompt, content: Any, index: int) -> None:
    prompt.last_user_text = " ".join(_text_of(content))
    for j, block in enumerate(content if isinstance(content, list) else ()):
        if block.get("type") == "tool_result":
            prompt.tool_results.append(" ".join(_text_of(block.get("content"))))
        elif block.get("type") == "image" and block.get("source", {}).get("type") == "base64":
            source, where = (
                block["source"],
                f"messages.{index}.content.{j}.image.source.base64.data",
            )
            data = script.decode_base64(source.get("data", ""), where)
            sniffed = script.sniff_media_type(data)
            if source.get("media_type") != sniffed:
                raise BadRequest(
                    f"{where}: The image was specified using the {source.get('media_type')} media "
                    f"type, but the image appears to be a {sniffed} image",
                    "messages",
                )
            prompt.images.append(script.Image(source["media_type"], data))


def _read_tools(prompt: Prompt, body: dict) -> None:
    tools, choice = body.get("tools") or [], body.get("tool_choice") or {"type": "auto"}
    if tools and choice.get("type") != "none":
        prompt.tool_name = choice.get("name") if choice.get("type") == "tool" else tools[0]["name"]
    thinking = body.get("thinking") or {}
    prompt.think = thinking.get("type") == "enabled"


def _usage(reply: Reply, output_tokens: int) -> dict:
    return {
        "input_tokens": reply.input_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }


def _message(
    message_id: str,
    model: str,
    content: list,
    reply: Reply | None,
    output_tokens: int,
    usage_reply: Reply,
) -> dict:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reply.stop_reason if reply else None,
        "stop_sequence": reply.stop_sequence if reply else None,
        "usage": _usage(usage_reply, output_tokens),
    }


def _tool_use_block(reply: Reply, full: bool) -> dict:
    call = reply.tool_call
    return {
        "type": "tool_use",
        "id": "toolu_01" + call.call_id,
        "name": call.name,
        "input": call.arguments if full else {},
    }


def complete(reply: Reply, message_id: str, model: str) -> dict:
    """The non-stream Message."""
    content: list[dict] = []
    if reply.thinking:
        content.append({"type": "thinking", "thinking": reply.thinking, "signature": SIGNATURE})
    if reply.tool_call:
        content.append(_tool_use_block(reply, full=True))
    else:
        content.append({"type": "text", "text": reply.text()})
    return _message(message_id, model, content, reply, reply.output_tokens, reply)


def _sse(event: str, data: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


async def stream(reply: Reply, message_id: str, model: str, index: int) -> AsyncIterator[bytes]:
    """The SSE event sequence of a streamed Message."""
    yield _sse(
        "message_start",
        {"type": "message_start", "message": _message(message_id, model, [], None, 1, reply)},
    )
    block = 0
    if reply.thinking:
        yield _sse(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            },
        )
        yield _sse("ping", {"type": "ping"})
        for piece in script.split_words(reply.thinking):
            yield _delta(0, {"type": "thinking_delta", "thinking": piece})
        yield _delta(0, {"type": "signature_delta", "signature": SIGNATURE})
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
        block = 1
    if reply.tool_call:
        start_block = _tool_use_block(reply, full=False)
        first_delta = {"type": "input_json_delta", "partial_json": ""}
    else:
        start_block, first_delta = {"type": "text", "text": ""}, None
    yield _sse(
        "content_block_start",
        {"type": "content_block_start", "index": block, "content_block": start_block},
    )
    if not reply.thinking:
        yield _sse("ping", {"type": "ping"})
    if first_delta:
        yield _delta(block, first_delta)
    sent = 0
    async for item in paced(reply.items, reply.interval):
        if reply.fail_after is not None and sent == reply.fail_after:
            break
        kind = "partial_json" if reply.tool_call else "text"
        yield _delta(
            block, {"type": "input_json_delta" if reply.tool_call else "text_delta", kind: item}
        )
        sent += 1
    if reply.fail_after is not None:
        yield _sse(
            "error",
            {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "Overloaded"},
                "request_id": request_id(index),
            },
        )
        return
    yield _sse("content_block_stop", {"type": "content_block_stop", "index": block})
    usage = _usage(reply, sent)
    del usage["cache_creation"], usage["service_tier"]
    yield _sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": reply.stop_reason, "stop_sequence": reply.stop_sequence},
            "usage": usage,
        },
    )
    yield _sse("message_stop", {"type": "message_stop"})


def _delta(index: int, delta: dict) -> bytes:
    return _sse(
        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )


def model_info(model_id: str) -> dict:
    return {
        "type": "model",
        "id": model_id,
        "display_name": model_id.rsplit("-", 1)[0].replace("-", " ").title(),
        "created_at": "2025-09-29T00:00:00Z",
        "lifecycle": "active",
        "deprecated_at": None,
        "retires_at": None,
        "max_input_tokens": 200000,
        "max_tokens": 64000,
    }


def create_app(*, api_key: str | None = None, models: Sequence[str] = MODELS) -> FastAPI:
    """A fresh fake; `api_key` set → only that x-api-key is accepted (else any non-empty one)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    init_state(app)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        index, body = await record(request)
        if failure := check_headers(request, api_key):
            return error_response(*failure, index)
        if body is None:
            return error_response(
                400, "There was an issue with the request body: invalid JSON", index
            )
        try:
            prompt = to_prompt(body)
        except BadRequest as bad:
            return error_response(400, str(bad), index)
        reply = script.decide(prompt)
        if reply.fail_status:
            retry = {"retry-after": "1"} if reply.fail_status == 429 else {}
            message = ERROR_MESSAGES.get(reply.fail_status, f"scripted failure {reply.fail_status}")
            return error_response(reply.fail_status, message, index, retry)
        message_id = "msg_01" + hashlib.sha256(f"{index}".encode()).hexdigest()[:22]
        if not body.get("stream"):
            if reply.fail_after is not None:
                return error_response(529, "Overloaded", index)
            return JSONResponse(
                complete(reply, message_id, body["model"]),
                headers={"request-id": request_id(index)},
            )
        return EventStream(
            stream(reply, message_id, body["model"], index),
            "text/event-stream; charset=utf-8",
            {"request-id": request_id(index)},
            index,
            app.state.cancelled,
        )

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        index, _ = await record(request)
        if failure := check_headers(request, api_key):
            return error_response(*failure, index)
        data = [model_info(m) for m in models]
        return JSONResponse(
            {
                "data": data,
                "has_more": False,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
            },
            headers={"request-id": request_id(index)},
        )

    return app
