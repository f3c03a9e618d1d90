"""A fake OpenAI Responses server: `POST /v1/responses` (JSON and SSE), as api.openai.com renders
it.

Renders `script.decide`; its bodies carry fields the gateway does not model (`service_tier`,
`billing`, annotations, `x_fake_extra`) so that a test can see a reply arrive whole.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from . import script
from .openai_upstream import check_auth, error_response
from .recording import EventStream, init_state, paced, record
from .script import BadRequest, Prompt, Reply

CREATED = 1_760_000_000


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    return [p.get("text", "") for p in content or () if isinstance(p, dict) and "text" in p]


def to_prompt(body: Any) -> Prompt:
    if not isinstance(body, dict) or "model" not in body:
        raise BadRequest("Missing required parameter: 'model'.", "model")
    items = body.get("input")
    items = (
        [{"type": "message", "role": "user", "content": items}]
        if isinstance(items, str)
        else items or []
    )
    prompt = Prompt(max_tokens=body.get("max_output_tokens"))
    for item in items:
        if item.get("type", "message") == "message":
            prompt.texts += _texts(item.get("content"))
    last_call = max(
        (i for i, it in enumerate(items) if it.get("type") == "function_call"), default=-1
    )
    prompt.tool_results = [
        str(it.get("output"))
        for it in items[last_call + 1 :]
        if it.get("type") == "function_call_output"
    ]
    users = [
        it for it in items if it.get("type", "message") == "message" and it.get("role") == "user"
    ]
    prompt.last_user_text = " ".join(_texts(users[-1].get("content"))) if users else ""
    tools = [t for t in body.get("tools") or [] if t.get("type") == "function"]
    if tools and body.get("tool_choice", "auto") != "none":
        prompt.tool_name = tools[0]["name"]
    return prompt


def _item(reply: Reply, rid: str) -> dict:
    if reply.tool_call:
        call = reply.tool_call
        return {
            "id": "fc_" + rid,
            "type": "function_call",
            "status": "completed",
            "call_id": "call_" + call.call_id,
            "name": call.name,
            "arguments": json.dumps(call.arguments),
        }
    part = {"type": "output_text", "text": reply.text(), "annotations": [], "logprobs": []}
    return {
        "id": "msg_" + rid,
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [part],
    }


def _response(body: dict, rid: str, status: str, output: list, usage: dict | None) -> dict:
    return {
        "id": "resp_" + rid,
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "model": body["model"],
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "store": body.get("store", True),
        "service_tier": "default",
        "billing": {"payer": "developer"},
        "x_fake_extra": {"kept": True},
        "usage": usage,
        "metadata": body.get("metadata") or {},
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
    }


def _usage(reply: Reply, output_tokens: int) -> dict:
    return {
        "input_tokens": reply.input_tokens,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": reply.input_tokens + output_tokens,
    }


async def stream(reply: Reply, body: dict, rid: str) -> AsyncIterator[bytes]:
    seq = 0

    def event(kind: str, **data: Any) -> bytes:
        nonlocal seq
        out = (
            b"event: "
            + kind.encode()
            + b"\ndata: "
            + orjson.dumps({"type": kind, "sequence_number": seq, **data})
        )
        seq += 1
        return out + b"\n\n"

    yield event("response.created", response=_response(body, rid, "in_progress", [], None))
    yield event("response.in_progress", response=_response(body, rid, "in_progress", [], None))
    item = _item(reply, rid)
    at = {"item_id": item["id"], "output_index": 0}
    if reply.tool_call:
        yield event(
            "response.output_item.added",
            output_index=0,
            item={**item, "arguments": "", "status": "in_progress"},
        )
        async for fragment in paced(reply.items, reply.interval):
            yield event(
                "response.function_call_arguments.delta", **at, delta=fragment, obfuscation="x"
            )
        yield event("response.function_call_arguments.done", **at, arguments=item["arguments"])
    else:
        yield event(
            "response.output_item.added",
            output_index=0,
            item={**item, "content": [], "status": "in_progress"},
        )
        yield event(
            "response.content_part.added",
            **at,
            content_index=0,
            part={"type": "output_text", "text": "", "annotations": []},
        )
        sent = 0
        async for chunk in paced(reply.items, reply.interval):
            if reply.fail_after is not None and sent == reply.fail_after:
                yield event(
                    "error", code="server_error", message="The server had an error.", param=None
                )
                return
            yield event(
                "response.output_text.delta",
                **at,
                content_index=0,
                delta=chunk,
                logprobs=[],
                obfuscation="x",
            )
            sent += 1
        yield event(
            "response.output_text.done", **at, content_index=0, text=reply.text(), logprobs=[]
        )
        yield event("response.content_part.done", **at, content_index=0, part=item["content"][0])
    yield event("response.output_item.done", output_index=0, item=item)
    yield event(
        "response.completed",
        response=_response(body, rid, "completed", [item], _usage(reply, reply.output_tokens)),
    )


def create_app(*, api_key: str | None = None) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    init_state(app)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        index, body = await record(request)
        if failure := check_auth(request, api_key):
            return failure
        try:
            prompt = to_prompt(body)
        except BadRequest as bad:
            return error_response(400, index, str(bad), bad.param)
        reply = script.decide(prompt)
        if reply.fail_status:
            return error_response(reply.fail_status, index)
        rid = hashlib.sha256(f"{index}".encode()).hexdigest()[:32]
        if not body.get("stream"):
            out = [_item(reply, rid)]
            return JSONResponse(
                _response(body, rid, "completed", out, _usage(reply, reply.output_tokens))
            )
        return EventStream(
            stream(reply, body, rid),
            "text/event-stream; charset=utf-8",
            {},
            index,
            app.state.cancelled,
        )

    return app
