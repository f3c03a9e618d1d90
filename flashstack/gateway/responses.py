"""The OpenAI Responses API at the gateway: `POST /v1/responses` end to end, and stored responses.

A request goes through the same steps as a chat request (chat.py: auth, limits, images, sessions'
admission, compression, routing), translated through the canonical types for every upstream. With
`store` (the API's default) the response is kept before its last event (or its body) goes out;
`previous_response_id` continues from one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.background import BackgroundTask, BackgroundTasks
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from flashstack.gateway import chat, overhead, validation, vision
from flashstack.gateway.auth import Caller
from flashstack.gateway.core import (
    ChatRequest,
    ErrorKind,
    Event,
    Finish,
    GatewayError,
    invalid_request,
)
from flashstack.gateway.requestlog import RequestRecord
from flashstack.gateway.responses_store import ResponseStore
from flashstack.gateway.routing import Router, RouteTrace
from flashstack.gateway.sessions import hooks as session_hooks
from flashstack.gateway.streaming import EventStream, sse
from flashstack.gateway.translate import fields
from flashstack.gateway.translate import responses as t
from flashstack.gateway.wire import responses as w

if TYPE_CHECKING:
    from flashstack.gateway.services import Services

log = logging.getLogger("flashstack.gateway")


async def handle(request: Request, services: Services, limits: chat.Limits) -> Response:
    """Serve one Responses request; every failure is an OpenAI error body (or, streamed, event)."""
    trace = RouteTrace.from_header(request.headers.get("x-request-id"))
    requests = services.requests
    record = requests.begin(trace, t.WIRE, request.method, request.url.path, request.headers)
    response = await _serve(request, services, limits, trace, record)
    if isinstance(response, EventStream):
        response.background = BackgroundTasks(
            [
                response.background,
                BackgroundTask(
                    requests.end, record, 200, None, response.headers.get("x-flashstack-dropped")
                ),
            ]
        )
    else:
        await requests.end(
            record, response.status_code, dropped=response.headers.get("x-flashstack-dropped")
        )
    return response


class _Saver:
    """Keeps a finished response with what came before it, when the request asked to store it."""

    def __init__(
        self, store: ResponseStore, owner: str, opts: t.Options, history: list[dict[str, Any]]
    ) -> None:
        self.store, self.owner, self.opts, self.history = store, owner, opts, history

    async def save(self, body: dict[str, Any]) -> None:
        if self.opts.store:
            items = self.opts.items
            await self.store.save(self.owner, items, self.history + items, body)


async def _serve(
    request: Request,
    services: Services,
    limits: chat.Limits,
    trace: RouteTrace,
    record: RequestRecord,
) -> Response:
    clock = overhead.start()
    req: ChatRequest | None = None
    router = services.router
    try:
        caller = await session_hooks.authenticate(request, services.auth)
        record.key_id = caller.key_id
        body = await chat.read_json(request, limits.max_body_bytes)
        parsed = _parse(body, limits.max_json_depth)
        store = response_store(services)
        history = await _history(store, caller, parsed.previous_response_id)
        req = t.to_canonical(parsed, body, history, passes_through(router, parsed.model))
        validation.check_tool_arguments(req, limits.max_json_depth)
        opts = _options(parsed, body)
        record.request(req)
        req.headers = fields.client_headers(request.headers)
        chat.check_capabilities(req, router.config_of(req.model))
        validation.check_request(req)
        await vision.prepare(req, vision.target_configs(router, req.model), limits.vision)
        turn = await session_hooks.begin_turn(services, request, req, caller, body)
        record.charged = turn.reservation.budget
        saver = _Saver(store, caller.owner, opts, history)
        async with turn.guard():
            req, squeezed = await services.compressor.prepare_context(req, turn)
            if req.stream:
                events = await turn.route(router).open_stream(req, trace)
                if req.response_format is not None:
                    events = chat._validated(events, req)
                encoder = t.StreamEncoder(parsed.model, opts, req.exchange.dropped)
                events = _stored(turn.watch(events), encoder, saver)
                stream = sse(
                    events, encoder.encode, limits.stream_queue_size, None, limits.ping_interval
                )
                headers = {
                    "cache-control": "no-cache",
                    "x-accel-buffering": "no",
                    **fields.response_headers(req),
                    **trace.headers(),
                }
                response = EventStream(
                    stream,
                    media_type="text/event-stream",
                    headers=headers,
                    background=BackgroundTask(turn.close_stream),
                )
                return overhead.stamp(clock, squeezed.stamp(response))
            resp = await turn.route(router).complete(req, trace)
            if req.response_format is not None:
                validation.check_output(req.response_format, resp.text())
            await turn.complete(resp)
            out = t.response_json(resp, parsed.model, opts)
            req.exchange.dropped.update(t.unrendered(resp))
            await saver.save(out)  # kept before the client sees it
            headers = {**fields.response_headers(req), **trace.headers()}
            return overhead.stamp(clock, squeezed.stamp(chat.json_response(out, headers=headers)))
    except GatewayError as e:
        record.error = e.message
        upstream = fields.response_headers(req) if req is not None else {}
        return chat.error_response(chat.OPENAI, e, {**upstream, **trace.headers()})
    except ClientDisconnect:
        return Response(status_code=499)
    except Exception:
        log.exception("unexpected error serving a responses request")
        return chat.error_response(
            chat.OPENAI, GatewayError(ErrorKind.INTERNAL, "internal error; see the gateway log")
        )


def passes_through(router: Router, model: str) -> bool:
    """Every deployment of `model` serves the Responses API itself: the request goes to it whole."""
    deps = router.groups.get(model) or []
    return bool(deps) and all(d.cfg.responses_api and d.cfg.provider == "openai" for d in deps)


def _parse(body: Any, max_depth: int) -> w.ResponsesRequest:
    if isinstance(body, dict):
        validation.check_depth(body, max_depth)
    return chat.parse_object(w.ResponsesRequest, body)


def _options(parsed: w.ResponsesRequest, body: dict[str, Any]) -> t.Options:
    items = [_with_id(item) for item in t.input_items(parsed)]
    return t.Options(
        body,
        store=parsed.store is not False,
        include_encrypted=t.ENCRYPTED in (parsed.include or ()),
        previous_response_id=parsed.previous_response_id,
        items=items,
        namespaces=t.namespaces(body),
    )


_ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def _with_id(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as `input_items` lists it: with an id (the API gives every stored item one)."""
    kind = item.get("type", "message")
    out = {"id": t.new_id(_ID_PREFIX.get(kind, "item")), "type": kind, **item}
    # listed as parts, as the API lists it
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": item["content"]}]
    return out


async def _history(
    store: ResponseStore, caller: Caller, previous: str | None
) -> list[dict[str, Any]]:
    if not previous:
        return []
    return (await store.get(caller.owner, previous)).items_after()


async def _stored(
    events: AsyncIterator[Event], encoder: t.StreamEncoder, saver: _Saver
) -> AsyncIterator[Event]:
    """`events`, with the response stored before its Finish goes out (a broken stream
    stores nothing)."""
    try:
        async for ev in events:
            if isinstance(ev, Finish):
                await saver.save(encoder.finish(ev))
            yield ev
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def response_store(services: Services) -> ResponseStore:
    return ResponseStore(services.sessions.store.db)


# ---- GET / DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items ------------------------


async def get_response(request: Request, services: Services, response_id: str) -> Response:
    caller = await session_hooks.authenticate(request, services.auth)
    stored = await response_store(services).get(caller.owner, response_id)
    return chat.json_response(stored.response)


async def delete_response(request: Request, services: Services, response_id: str) -> Response:
    caller = await session_hooks.authenticate(request, services.auth)
    await response_store(services).delete(caller.owner, response_id)
    return chat.json_response({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: Request, services: Services, response_id: str) -> Response:
    """The response's own input items, newest first unless `order=asc` (as the API lists them)."""
    caller = await session_hooks.authenticate(request, services.auth)
    items = (await response_store(services).get(caller.owner, response_id)).input_items
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_request("order must be asc or desc", "order")
    data = items if order == "asc" else items[::-1]
    return chat.json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": False,
        }
    )
