"""A fake Ollama server: native `POST /api/chat` (NDJSON or one JSON), `GET /api/tags`, `GET
/api/version`.

Renders `script.decide` in the wire format of Ollama's own API (not its OpenAI-compatible one).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from . import script
from .recording import EventStream, init_state, paced, record
from .script import BadRequest, Prompt, Reply

MODELS = ("llama3.2:latest", "qwen3:0.6b")
VERSION = "0.12.6"
CREATED_AT = "2025-10-20T12:00:00.123456789Z"
DONE_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "stop",
    "max_tokens": "length",
}
NANOS_PER_TOKEN = 10_000_000


def error_response(status: int, message: str, headers: dict | None = None) -> Response:
    return JSONResponse({"error": message}, status, headers=headers)


def to_prompt(body: Any) -> Prompt:
    """Validate the request as Ollama does (the fields the fake reads) and reduce it."""
    if not isinstance(body, dict):
        raise BadRequest("invalid request body")
    if not body.get("model"):
        raise BadRequest("model is required")
    messages = body.get("messages") or []
    options = body.get("options") or {}
    stop = options.get("stop") or ()
    limit = options.get("num_predict")
    prompt = Prompt(
        max_tokens=limit if limit and limit > 0 else None,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        think=bool(body.get("think")),
    )
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content", ""), str):
            raise BadRequest("invalid message format")
        prompt.texts.append(message.get("content") or "")
    last_assistant = max(
        (i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1
    )
    prompt.tool_results = [
        m.get("content") or "" for m in messages[last_assistant + 1 :] if m.get("role") == "tool"
    ]
    users = [m for m in messages if m.get("role") == "user"]
    if users:
        prompt.last_user_text = users[-1].get("content") or ""
        for image in users[-1].get("images") or ():
            try:
                data = script.decode_base64(image, "images")
            except BadRequest:
                raise BadRequest("illegal base64 data at input byte 0") from None
            prompt.images.append(script.Image(script.sniff_media_type(data), data))
    tools = body.get("tools") or []
    if tools:
        prompt.tool_name = tools[0]["function"]["name"]
    return prompt


def _tool_calls(reply: Reply) -> list[dict]:
    call = reply.tool_call
    return [
        {
            "id": "call_" + call.call_id[:8],
            "function": {"index": 0, "name": call.name, "arguments": call.arguments},
        }
    ]


def _final(model: str, reply: Reply, eval_count: int, message: dict) -> dict:
    return {
        "model": model,
        "created_at": CREATED_AT,
        "message": message,
        "done": True,
        "done_reason": DONE_REASONS[reply.stop_reason],
        "total_duration": (reply.input_tokens + eval_count) * NANOS_PER_TOKEN + 1_000_000,
        "load_duration": 1_000_000,
        "prompt_eval_count": reply.input_tokens,
        "prompt_eval_duration": reply.input_tokens * NANOS_PER_TOKEN,
        "eval_count": eval_count,
        "eval_duration": eval_count * NANOS_PER_TOKEN,
    }


def complete(reply: Reply, model: str) -> dict:
    """The non-stream response: one object with the whole message and the final counters."""
    message: dict = {"role": "assistant", "content": "" if reply.tool_call else reply.text()}
    if reply.thinking:
        message["thinking"] = reply.thinking
    if reply.tool_call:
        message["tool_calls"] = _tool_calls(reply)
    return _final(model, reply, reply.output_tokens or 1, message)


async def stream(reply: Reply, model: str) -> AsyncIterator[bytes]:
    """NDJSON lines: message fragments with done=false, then the final line with the counters."""

    def line(message: dict) -> bytes:
        return (
            orjson.dumps(
                {"model": model, "created_at": CREATED_AT, "message": message, "done": False}
            )
            + b"\n"
        )

    for piece in script.split_words(reply.thinking or ""):
        yield line({"role": "assistant", "content": "", "thinking": piece})
    sent = 0
    if reply.tool_call:
        # Ollama parses a whole tool call before sending it: one line, arguments as an object.
        yield line({"role": "assistant", "content": "", "tool_calls": _tool_calls(reply)})
        sent = len(reply.tool_call.fragments)
    else:
        async for item in paced(reply.chunks, reply.interval):
            if reply.fail_after is not None and sent == reply.fail_after:
                break
            yield line({"role": "assistant", "content": item})
            sent += 1
    if reply.fail_after is not None:
        yield (
            orjson.dumps(
                {"error": "an error was encountered while running the model: unexpected EOF"}
            )
            + b"\n"
        )
        return
    yield orjson.dumps(_final(model, reply, sent, {"role": "assistant", "content": ""})) + b"\n"


def model_entry(name: str) -> dict:
    digest = hashlib.sha256(name.encode()).hexdigest()
    family = name.split(":")[0].rstrip("0123456789.")
    return {
        "name": name,
        "model": name,
        "modified_at": "2025-10-01T09:00:00.000000000Z",
        "size": 2_019_393_189,
        "digest": digest,
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": family,
            "families": [family],
            "parameter_size": "3.2B",
            "quantization_level": "Q4_K_M",
        },
    }


def create_app(*, models: Sequence[str] = MODELS) -> FastAPI:
    """A fresh fake Ollama (no auth, like a local Ollama)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    init_state(app)

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        index, body = await record(request)
        if body is None:
            return error_response(400, "invalid character looking for beginning of value")
        try:
            prompt = to_prompt(body)
        except BadRequest as bad:
            return error_response(400, str(bad))
        if body["model"] not in models and f"{body['model']}:latest" not in models:
            return error_response(404, f"model '{body['model']}' not found")
        reply = script.decide(prompt)
        if reply.fail_status:
            retry = {"retry-after": "1"} if reply.fail_status == 429 else {}
            return error_response(reply.fail_status, f"scripted failure {reply.fail_status}", retry)
        if body.get("stream") is False:
            if reply.fail_after is not None:
                return error_response(
                    500, "an error was encountered while running the model: unexpected EOF"
                )
            return JSONResponse(complete(reply, body["model"]))
        return EventStream(
            stream(reply, body["model"]), "application/x-ndjson", {}, index, app.state.cancelled
        )

    @app.get("/api/tags")
    async def tags(request: Request) -> Response:
        await record(request)
        return JSONResponse({"models": [model_entry(m) for m in models]})

    @app.get("/api/version")
    async def version(request: Request) -> Response:
        await record(request)
        return JSONResponse({"version": VERSION})

    @app.get("/")
    async def root(request: Request) -> Response:
        await record(request)
        return PlainTextResponse("Ollama is running")

    return app
