"""A fake OpenAI-compatible server: `POST /v1/chat/completions` (JSON and SSE) and `GET /v1/models`.

Renders `script.decide` in the wire format of api.openai.com as the `openai` SDK parses it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from . import script
from .recording import EventStream, init_state, paced, record
from .script import BadRequest, Prompt, Reply

MODELS = ("gpt-4o-mini", "gpt-4.1")
CREATED = 1_760_000_000
FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
}
SYSTEM_FINGERPRINT = "fp_fake0001"
# (type, code, message) per status, as api.openai.com words them.
ERRORS = {
    400: ("invalid_request_error", None, "Invalid request."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    403: (
        "invalid_request_error",
        "unsupported_country_region_territory",
        "Country not supported.",
    ),
    404: (
        "invalid_request_error",
        "model_not_found",
        "The model does not exist or you do not have access to it.",
    ),
    429: ("requests", "rate_limit_exceeded", "Rate limit reached for requests."),
    500: (
        "server_error",
        None,
        "The server had an error while processing your request. Sorry about that!",
    ),
    503: ("server_error", None, "The engine is currently overloaded, please try again later."),
}


def error_body(
    status: int, message: str | None = None, param: str | None = None, code: str | None = None
) -> dict:
    error_type, default_code, default_message = ERRORS.get(
        status,
        ("server_error" if status >= 500 else "invalid_request_error", None, f"Error {status}."),
    )
    return {
        "error": {
            "message": message or default_message,
            "type": error_type,
            "param": param,
            "code": code or default_code,
        }
    }


def error_response(
    status: int,
    index: int,
    message: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
) -> Response:
    return JSONResponse(
        error_body(status, message, param, code),
        status,
        headers={"x-request-id": request_id(index), **(headers or {})},
    )


def request_id(index: int) -> str:
    return "req_" + hashlib.sha256(f"openai{index}".encode()).hexdigest()[:32]


def check_auth(request: Request, api_key: str | None) -> Response | None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key:
        return error_response(
            401,
            -1,
            "You didn't provide an API key. You need to provide your API key "
            "in an Authorization header using Bearer auth (i.e. Authorization: "
            "Bearer YOUR_KEY).",
            code="missing_api_key",
        )
    if api_key is not None and key != api_key:
        return error_response(401, -1, f"Incorrect API key provided: {key[:3]}***.")
    return None


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    return [
        p.get("text", "") for p in content or () if isinstance(p, dict) and p.get("type") == "text"
    ]


def to_prompt(body: Any) -> Prompt:
    """Validate the request as the real API does (the fields the fake reads) and reduce it."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    for name in ("model", "messages"):
        if name not in body:
            raise BadRequest(f"Missing required parameter: '{name}'.", name)
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            "Invalid 'messages': empty array. Expected an array with minimum length 1.", "messages"
        )
    stop = body.get("stop") or ()
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    prompt = Prompt(max_tokens=limit, stop=(stop,) if isinstance(stop, str) else tuple(stop))
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
            "function",
        ):
            raise BadRequest(f"Invalid value for 'messages[{i}].role'.", f"messages[{i}].role")
        prompt.texts += _texts(message.get("content"))
    last_assistant = max(
        (i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1
    )
    tail = messages[last_assistant + 1 :]
    prompt.tool_results = [" ".join(_texts(m.get("content"))) for m in tail if m["role"] == "tool"]
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if users:
        _read_user(prompt, messages[users[-1]].get("content"), users[-1])
    tools, choice = body.get("tools") or [], body.get("tool_choice", "auto")
    if tools and choice != "none":
        forced = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        prompt.tool_name = forced or tools[0]["function"]["name"]
    return prompt


def _read_user(prompt: Prompt, content: Any, index: int) -> None:
    prompt.last_user_text = " ".join(_texts(content))
    for j, part in enumerate(content if isinstance(content, list) else ()):
        if part.get("type") != "image_url":
            continue
        url, where = (
            part.get("image_url", {}).get("url", ""),
            f"messages[{index}].content[{j}].image_url",
        )
        header, _, data = url.partition(",")
        if not (header.startswith("data:") and header.endswith(";base64")):
            prompt.images.append(script.Image("url", b""))
            continue
        try:
            decoded = script.decode_base64(data, where)
        except BadRequest:
            raise BadRequest("Invalid base64 image_url.", where) from None
        prompt.images.append(script.Image(header[5:-7], decoded))


def _usage(reply: Reply, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": reply.input_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": reply.input_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _envelope(completion_id: str, model: str, obj: str) -> dict:
    return {
        "id": completion_id,
        "object": obj,
        "created": CREATED,
        "model": model,
        "service_tier": "default",
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def _tool_call(reply: Reply) -> dict:
    call = reply.tool_call
    return {
        "id": "call_" + call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
    }


def complete(reply: Reply, completion_id: str, model: str, usage: bool = True) -> dict:
    """The non-stream ChatCompletion (without `usage` when told so)."""
    message: dict = {"role": "assistant", "content": None, "refusal": None, "annotations": []}
    if reply.tool_call:
        message["tool_calls"] = [_tool_call(reply)]
    else:
        message["content"] = reply.text()
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": FINISH_REASONS[reply.stop_reason],
    }
    body = {**_envelope(completion_id, model, "chat.completion"), "choices": [choice]}
    if usage:
        body["usage"] = _usage(reply, reply.output_tokens)
    return body


async def stream(
    reply: Reply, completion_id: str, model: str, include_usage: bool
) -> AsyncIterator[bytes]:
    """`data: {chunk}` lines, the finish chunk, the usage chunk if asked for, then `data:
    [DONE]`."""
    envelope = _envelope(completion_id, model, "chat.completion.chunk")
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return b"data: " + orjson.dumps({**envelope, "choices": [choice], **extra}) + b"\n\n"

    if reply.tool_call:
        call = _tool_call(reply)
        call["function"]["arguments"] = ""
        yield chunk(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"index": 0, **call}],
                "refusal": None,
            }
        )
    else:
        yield chunk({"role": "assistant", "content": "", "refusal": None})
    sent = 0
    async for item in paced(reply.items, reply.interval):
        if reply.fail_after is not None and sent == reply.fail_after:
            break
        if reply.tool_call:
            yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": item}}]})
        else:
            yield chunk({"content": item})
        sent += 1
    if reply.fail_after is not None:
        yield b"data: " + orjson.dumps(error_body(500)) + b"\n\n"
        return
    yield chunk({}, FINISH_REASONS[reply.stop_reason])
    if include_usage:
        yield (
            b"data: "
            + orjson.dumps({**envelope, "choices": [], "usage": _usage(reply, sent)})
            + b"\n\n"
        )
    yield b"data: [DONE]\n\n"


def create_app(
    *,
    api_key: str | None = None,
    models: Sequence[str] = MODELS,
    stream_usage: bool = True,
    reply_usage: bool = True,
) -> FastAPI:
    """A fresh fake; `api_key` set → only that bearer key is accepted (else any non-empty one).

    `stream_usage` False: streams carry no usage whatever stream_options asks, as llama.cpp's
    server. `reply_usage` False: whole replies carry none either (a proxy that strips it).
    """
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    init_state(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        index, body = await record(request)
        if failure := check_auth(request, api_key):
            return failure
        if body is None:
            return error_response(400, index, "We could not parse the JSON body of your request.")
        try:
            prompt = to_prompt(body)
        except BadRequest as bad:
            return error_response(400, index, str(bad), bad.param)
        reply = script.decide(prompt)
        if reply.fail_status:
            retry = {"retry-after": "1"} if reply.fail_status == 429 else {}
            return error_response(reply.fail_status, index, headers=retry)
        completion_id = "chatcmpl-" + hashlib.sha256(f"{index}".encode()).hexdigest()[:29]
        if not body.get("stream"):
            if reply.fail_after is not None:
                return error_response(500, index)
            return JSONResponse(
                complete(reply, completion_id, body["model"], reply_usage),
                headers={"x-request-id": request_id(index)},
            )
        include_usage = stream_usage and bool(
            (body.get("stream_options") or {}).get("include_usage")
        )
        return EventStream(
            stream(reply, completion_id, body["model"], include_usage),
            "text/event-stream; charset=utf-8",
            {"x-request-id": request_id(index)},
            index,
            app.state.cancelled,
        )

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        await record(request)
        if failure := check_auth(request, api_key):
            return failure
        data = [
            {"id": m, "object": "model", "created": CREATED, "owned_by": "system"} for m in models
        ]
        return JSONResponse({"object": "list", "data": data})

    return app
