"""One chat request end to end: wire in → canonical → router → canonical → wire out."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask, BackgroundTasks
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from flashstack.gateway import compress, overhead, tokens, validation, vision
from flashstack.gateway.config import ModelConfig, ServerConfig, VisionConfig
from flashstack.gateway.content_encoding import read_body
from flashstack.gateway.core import (
    ChatRequest,
    Error,
    ErrorKind,
    Event,
    Finish,
    GatewayError,
    Image,
    TextDelta,
    invalid_request,
)
from flashstack.gateway.requestlog import RequestRecord
from flashstack.gateway.routing import Router, RouteTrace
from flashstack.gateway.sessions import hooks as session_hooks
from flashstack.gateway.sessions.turns import Turn
from flashstack.gateway.streaming import EventStream, sse
from flashstack.gateway.translate import anthropic as anthropic_t
from flashstack.gateway.translate import fields
from flashstack.gateway.translate import openai as openai_t
from flashstack.gateway.wire import anthropic as anthropic_w
from flashstack.gateway.wire import openai as openai_w

if TYPE_CHECKING:
    from flashstack.gateway.services import Services

log = logging.getLogger("flashstack.gateway")


class Encoder(Protocol):
    def encode(self, ev: Event) -> Iterable[bytes]: ...


@dataclass(frozen=True, slots=True)
class WireFormat:
    """Everything that differs between the OpenAI and Anthropic edges."""

    name: str
    request_type: type[BaseModel]
    to_canonical: Callable[[Any, Any], ChatRequest]
    response_json: Callable[[Any, str], dict[str, Any]]
    error_json: Callable[[GatewayError], dict[str, Any]]
    encoder: Callable[[ChatRequest], Encoder]
    ping: bytes | None


OPENAI = WireFormat(
    "openai",
    openai_w.ChatCompletionRequest,
    openai_t.to_canonical,
    openai_t.response_json,
    openai_t.error_json,
    lambda req: openai_t.StreamEncoder(req.model, req.include_usage, req.exchange.dropped),
    None,
)
ANTHROPIC = WireFormat(
    "anthropic",
    anthropic_w.MessagesRequest,
    anthropic_t.to_canonical,
    anthropic_t.response_json,
    anthropic_t.error_json,
    lambda req: anthropic_t.StreamEncoder(req.model, req.exchange.dropped),
    anthropic_t.PING,
)


DEFAULT_JSON_DEPTH = ServerConfig.model_fields["max_json_depth"].default


@dataclass(slots=True)
class Limits:
    max_body_bytes: int
    stream_queue_size: int
    ping_interval: float
    vision: VisionConfig = field(default_factory=VisionConfig)
    max_json_depth: int = DEFAULT_JSON_DEPTH  # server.max_json_depth


async def handle(
    wire: WireFormat, request: Request, services: Services, limits: Limits
) -> Response:
    """Serve one chat request; every failure becomes an error in the caller's format. The request
    log (and its trace) gets it when it ends: a stream when its last event went out."""
    # what routing did → headers
    trace = RouteTrace.from_header(request.headers.get("x-request-id"))
    requests = services.requests
    record = requests.begin(trace, wire.name, request.method, request.url.path, request.headers)
    response = await _serve(wire, request, services, limits, trace, record)
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


async def _serve(
    wire: WireFormat,
    request: Request,
    services: Services,
    limits: Limits,
    trace: RouteTrace,
    record: RequestRecord,
) -> Response:
    clock = overhead.start()  # → X-Flashstack-Overhead-Ms: this handler's time minus the upstreams'
    req: ChatRequest | None = None
    router = services.router
    try:
        # 401 before the body is read
        caller = await session_hooks.authenticate(request, services.auth)
        record.key_id = caller.key_id
        body = await read_json(request, limits.max_body_bytes)
        # Cheapest first: nothing costly (schema checks, images, sessions, compression) for a
        # request that a look at its fields refuses.
        req = parse(wire, body, limits.max_json_depth)
        record.request(
            req, request.headers.get(session_hooks.SESSION_HEADER) or req.metadata.get("session_id")
        )
        # anthropic-beta & co., for same-wire upstreams
        req.headers = fields.client_headers(request.headers)
        check_capabilities(req, router.config_of(req.model))  # unknown model → 404 before any work
        # a bad `compression` or schema: 400 before any session is touched
        validation.check_request(req)
        # Images: decoded, checked and resized for the model's upstreams (in a thread when large).
        await vision.prepare(req, vision.target_configs(router, req.model), limits.vision)
        # 403/429 for the key; with X-Session-Id the session is locked and its history prepended.
        turn = await session_hooks.begin_turn(services, request, req, caller, body)
        record.charged = turn.reservation.budget
        async with turn.guard():  # a failure below is stored as the turn's error, never half a turn
            # Over the model's window: compress (or 400 context_length_exceeded), said in
            # x-flashstack-* headers.
            req, squeezed = await services.compressor.prepare_context(req, turn)
            if req.stream:
                response = await stream_response(wire, req, turn.route(router), limits, trace, turn)
                return overhead.stamp(clock, squeezed.stamp(response))
            resp = await turn.route(router).complete(req, trace)
            if req.response_format is not None:
                validation.check_output(req.response_format, resp.text())
            await turn.complete(resp)  # stored before the client sees the reply
            # request ids, x-flashstack-dropped
            headers = {**fields.response_headers(req), **trace.headers()}
            response = json_response(wire.response_json(resp, req.model), headers=headers)
            return overhead.stamp(clock, squeezed.stamp(response))
    except GatewayError as e:
        record.error = e.message
        # An upstream's refusal keeps its request id and rate-limit headers: what a
        # client backs off by.
        upstream = fields.response_headers(req) if req is not None else {}
        return error_response(wire, e, {**upstream, **trace.headers()})
    except ClientDisconnect:
        return Response(status_code=499)
    except Exception:
        log.exception("unexpected error serving %s request", wire.name)
        return error_response(
            wire, GatewayError(ErrorKind.INTERNAL, "internal error; see the gateway log")
        )


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body, refused without reading further once it passes `limit` bytes.

    A gzip or deflate Content-Encoding is decoded, the limit applying to the decoded body too.
    """
    body = await read_body(request, limit)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise invalid_request(f"request body is not valid JSON: {e}") from None


def check_capabilities(req: ChatRequest, cfg: ModelConfig) -> None:
    """Refuse what the model cannot take, instead of silently dropping it (or paying
    to find out)."""
    window = tokens.context_window(cfg)
    if req.max_tokens is not None and window is not None and req.max_tokens >= window:
        raise compress.context_length_exceeded(
            f"max_tokens ({req.max_tokens}) leaves no room for the prompt in model {req.model!r}'s "
            f"{window}-token context window; lower max_tokens",
            "max_tokens",
        )
    if not cfg.supports_images and any(isinstance(p, Image) for m in req.messages for p in m.parts):
        raise invalid_request(
            f"model {req.model!r} does not accept images (supports_images: false in its config); "
            "remove the image parts or choose a vision model",
            "messages",
        )


def parse(wire: WireFormat, body: Any, max_depth: int = DEFAULT_JSON_DEPTH) -> ChatRequest:
    """The canonical request for a wire body; a 400 naming the field for anything malformed."""
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    validation.check_depth(body, max_depth)  # before anything walks it recursively
    try:
        parsed = wire.request_type.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    # the body too: what the canonical types do not model passes as sent
    req = wire.to_canonical(parsed, body)
    validation.check_tool_arguments(req, max_depth)
    return req


M = TypeVar("M", bound=BaseModel)


def parse_object(model: type[M], body: Any) -> M:
    """`body` as the wire model `model`; a 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(e: ValidationError) -> GatewayError:
    first = e.errors(include_url=False)[0]
    # Discriminated unions add the tag to the path ("messages.0.user.content"); keep it readable.
    loc = ".".join(str(p) for p in first["loc"])
    more = f" (and {e.error_count() - 1} more problems)" if e.error_count() > 1 else ""
    return invalid_request(f"{loc}: {first['msg']}{more}", loc or None)


async def stream_response(
    wire: WireFormat,
    req: ChatRequest,
    router: Router,
    limits: Limits,
    trace: RouteTrace,
    turn: Turn,
) -> Response:
    events = await router.open_stream(req, trace)  # failures before the first byte raise here
    if req.response_format is not None:
        events = _validated(events, req)
    events = turn.watch(events)  # the session turn is stored before the final event goes out
    body = sse(
        events, wire.encoder(req).encode, limits.stream_queue_size, wire.ping, limits.ping_interval
    )
    headers = {
        "cache-control": "no-cache",
        "x-accel-buffering": "no",
        **fields.response_headers(req),
        **trace.headers(),
    }
    # The background task runs even when the client left before the body began.
    return EventStream(
        body,
        media_type="text/event-stream",
        headers=headers,
        background=BackgroundTask(turn.close_stream),
    )


async def _validated(events: AsyncIterator[Event], req: ChatRequest) -> AsyncIterator[Event]:
    """Pass events through; replace the Finish with an Error if the text breaks the format."""
    text: list[str] = []
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                text.append(ev.text)
            elif isinstance(ev, Finish):
                try:
                    validation.check_output(req.response_format, "".join(text))
                except GatewayError as e:
                    yield Error(e)
                    return
            yield ev
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body), status_code=status, media_type="application/json", headers=headers
    )


def error_response(
    wire: WireFormat, err: GatewayError, headers: dict[str, str] | None = None
) -> Response:
    headers = dict(headers or {})
    if err.retry_after:
        headers["retry-after"] = str(max(1, round(err.retry_after)))
    if err.status == 413:  # the rest of the body is unread: a client must not reuse this connection
        headers["connection"] = "close"
    return json_response(wire.error_json(err), err.status, headers or None)
