"""The `/v1/sessions` and `/v1/keys` endpoints, shaped like OpenAI's Conversations API.

Each function takes the request and returns a response; errors come back in the caller's wire
format (Anthropic's when it sends `anthropic-version`, else OpenAI's), never as a traceback.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask, BackgroundTasks
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from flashstack.gateway import chat, compress
from flashstack.gateway.auth import Caller, may_use
from flashstack.gateway.core import (
    ChatRequest,
    ErrorKind,
    GatewayError,
    Message,
    Part,
    Text,
    invalid_request,
)
from flashstack.gateway.routing import Router, RouteTrace
from flashstack.gateway.sessions.store import Order, message_json
from flashstack.gateway.sessions.turns import Idempotency
from flashstack.gateway.tls import client_identity

if TYPE_CHECKING:
    from flashstack.gateway.services import Services

log = logging.getLogger("flashstack.sessions")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateSession(_Body):
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str | None = None
    system: str | None = None


class UpdateSession(_Body):
    metadata: dict[str, str]


class TextPart(_Body):
    type: Literal["text", "input_text"]
    text: str


class PostMessage(_Body):
    content: str | list[TextPart]
    model: str | None = None
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    compression: Literal["auto", "off", "truncate"] | None = None  # overrides metadata.compression


class CreateKey(_Body):
    name: str
    models: list[str] | None = None
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    expires_at: float | None = None  # unix seconds
    expires_in: float | None = Field(None, gt=0)  # seconds from now
    budget_day_usd: float | None = Field(None, gt=0)  # USD per UTC day (gateway/spend.py)
    budget_month_usd: float | None = Field(None, gt=0)  # USD per UTC month


class UpdateKey(_Body):
    """The fields of a key that may change; KeyStore.update checks the values (null: no limit)."""

    name: str | None = None
    models: list[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    expires_at: float | None = None
    budget_day_usd: float | None = None
    budget_month_usd: float | None = None


Handler = Callable[..., Awaitable[Response]]


def endpoint(fn: Handler) -> Handler:
    """Turn every failure of `fn` into an error response in the caller's wire format."""

    @functools.wraps(fn)
    async def run(request: Request, *args: Any, **kwargs: Any) -> Response:
        try:
            return await fn(request, *args, **kwargs)
        except GatewayError as e:
            return chat.error_response(wire_of(request), e)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:
            log.exception("unexpected error serving %s %s", request.method, request.url.path)
            err = GatewayError(ErrorKind.INTERNAL, "internal error; see the gateway log")
            return chat.error_response(wire_of(request), err)

    return run


def wire_of(request: Request) -> chat.WireFormat:
    return chat.ANTHROPIC if "anthropic-version" in request.headers else chat.OPENAI


async def _parse(
    request: Request, model: type[_Body], limit: int, empty_ok: bool = False
) -> tuple[Any, Any]:
    if (
        empty_ok
        and request.headers.get("content-length") in ("0", None)
        and not await request.body()
    ):
        return model.model_validate({}), {}
    body = await chat.read_json(request, limit)
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    try:
        return model.model_validate(body), body
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise invalid_request(f"{loc}: {first['msg']}", loc or None) from None


def _query_page(request: Request, default_order: Order) -> tuple[str | None, int, Order]:
    q = request.query_params
    raw_limit = q.get("limit", "20")
    try:
        limit = int(raw_limit)
    except ValueError:
        raise invalid_request(
            f"limit must be an integer from 1 to 100, got {raw_limit!r}", "limit"
        ) from None
    return q.get("after"), limit, q.get("order", default_order)  # type: ignore[return-value]


def _check_model(router: Router, caller: Caller, model: str) -> None:
    router.config_of(model)  # 404 with the list of models
    if not may_use(caller, model):
        raise GatewayError(
            ErrorKind.PERMISSION,
            f"API key {caller.key_id} may not use model {model!r}",
            param="model",
        )


# ---- sessions -------------------------------------------------------------------------------


@endpoint
async def create_session(request: Request, services: Services, limits: chat.Limits) -> Response:
    sessions, auth = services.sessions, services.auth
    caller = await auth.authenticate(request.headers, client_identity(request))
    body, _ = await _parse(request, CreateSession, limits.max_body_bytes, empty_ok=True)
    compress.session_mode(body.metadata)  # 400 for a bad metadata.compression
    if body.model is not None:
        _check_model(services.router, caller, body.model)
    if body.system is not None and len(body.system.encode()) > sessions.config.max_message_bytes:
        raise _too_large("system", sessions.config.max_message_bytes)
    await auth.count_request(caller)  # a session costs a request of the key's rpm (429)
    cap = sessions.config.max_sessions_per_key if caller.key_id is not None else None
    created = await sessions.store.create(caller.owner, body.metadata, body.model, body.system, cap)
    return chat.json_response(created)


@endpoint
async def get_session(request: Request, services: Services, session_id: str) -> Response:
    sessions, auth = services.sessions, services.auth
    caller = await auth.authenticate(request.headers, client_identity(request))
    return chat.json_response(await sessions.store.get(caller.owner, session_id))


@endpoint
async def update_session(
    request: Request, services: Services, session_id: str, limits: chat.Limits
) -> Response:
    sessions, auth = services.sessions, services.auth
    caller = await auth.authenticate(request.headers, client_identity(request))
    body, _ = await _parse(request, UpdateSession, limits.max_body_bytes)
    compress.session_mode(body.metadata)  # 400 for a bad metadata.compression
    return chat.json_response(await sessions.store.update(caller.owner, session_id, body.metadata))


@endpoint
async def delete_session(request: Request, services: Services, session_id: str) -> Response:
    sessions, auth = services.sessions, services.auth
    caller = await auth.authenticate(request.headers, client_identity(request))
    return chat.json_response(await sessions.store.delete(caller.owner, session_id))


@endpoint
async def list_sessions(request: Request, services: Services) -> Response:
    sessions, auth = services.sessions, services.auth
    caller = await auth.authenticate(request.headers, client_identity(request))
    after, limit, order = _query_page(request, "desc")
    page = await sessions.store.list(caller.owner, after, limit, order)
    return chat.json_response(page.json())


@endpoint
async def list_messages(request: Request, services: Services, session_id: str) -> Response:
    sessions, auth = services.sessions, services.auth
    caller = await auth.authenticate(request.headers, client_identity(request))
    after, limit, order = _query_page(request, "asc")
    page = await sessions.store.list_messages(caller.owner, session_id, after, limit, order)
    return chat.json_response(page.json())


@endpoint
async def post_message(
    request: Request, services: Services, session_id: str, limits: chat.Limits
) -> Response:
    """Append the user's message, run the model on the whole session, append and
    return its reply."""
    sessions, auth = services.sessions, services.auth
    router = services.router
    caller = await auth.authenticate(request.headers, client_identity(request))
    body, raw = await _parse(request, PostMessage, limits.max_body_bytes)
    parts = _content(body.content, sessions.config.max_message_bytes)
    session = await sessions.store.get(caller.owner, session_id)  # 404 before anything else
    model = body.model or session["model"]
    if not model:
        raise invalid_request("model: this session has no default model; pass one", "model")
    _check_model(router, caller, model)
    idem = Idempotency.of(request.headers, request.url.path, raw)
    turn = await sessions.open_turn(caller, session_id, [Message("user", parts)], idem)
    req = ChatRequest(
        model,
        turn.history + turn.inputs,
        turn.system(),
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        include_usage=True,
        stream=body.stream or "text/event-stream" in request.headers.get("accept", ""),
        extensions={} if body.compression is None else {"compression": body.compression},
    )
    await turn.admit(auth, req)  # 429 with retry-after; the history is part of what it costs
    trace = RouteTrace.from_header(request.headers.get("x-request-id"))
    requests = services.requests  # the request log: its cost row, its trace
    record = requests.begin(
        trace, wire_of(request).name, request.method, request.url.path, request.headers
    )
    record.key_id, record.charged = caller.key_id, turn.reservation.budget
    record.request(req, session_id)
    try:
        async with turn.guard():
            req, squeezed = await services.compressor.prepare_context(req, turn)
            if req.stream:
                response = await chat.stream_response(
                    wire_of(request), req, turn.route(router), limits, trace, turn
                )
                response.background = BackgroundTasks(
                    [response.background, BackgroundTask(requests.end, record, 200)]
                )
                return squeezed.stamp(response)
            resp = await turn.route(router).complete(req, trace)
            await turn.complete(resp)
    except GatewayError as e:
        await requests.end(record, e.status, e)
        raise
    await requests.end(record, 200)
    if turn.replay_message_id is not None:
        return chat.json_response(await sessions.store.message(turn.replay_message_id))
    return squeezed.stamp(chat.json_response(message_json(turn.rows[-1])))


def _content(content: str | list[TextPart], limit: int) -> list[Part]:
    texts = [content] if isinstance(content, str) else [p.text for p in content]
    if not texts or not any(texts):
        raise invalid_request("content must not be empty", "content")
    if sum(len(t.encode()) for t in texts) > limit:
        raise _too_large("content", limit)
    return [Text(t) for t in texts]


def _too_large(field: str, limit: int) -> GatewayError:
    return GatewayError(
        ErrorKind.REQUEST_TOO_LARGE,
        f"{field} is larger than the session message limit of {limit} bytes "
        "(store.max_message_bytes)",
        param=field,
    )


# ---- API keys (master key only) -------------------------------------------------------------


@endpoint
async def create_key(request: Request, services: Services, limits: chat.Limits) -> Response:
    auth = services.auth
    auth.require_admin(await auth.authenticate(request.headers, client_identity(request)))
    body, _ = await _parse(request, CreateKey, limits.max_body_bytes)
    expires_at = body.expires_at
    if body.expires_in is not None:
        expires_at = time.time() + body.expires_in
    created = await auth.keys.create(
        body.name,
        body.models,
        body.rpm,
        body.tpm,
        expires_at,
        body.budget_day_usd,
        body.budget_month_usd,
    )
    return chat.json_response(created)


@endpoint
async def list_keys(request: Request, services: Services) -> Response:
    auth = services.auth
    auth.require_admin(await auth.authenticate(request.headers, client_identity(request)))
    data = await auth.keys.list()
    return chat.json_response(
        {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )


@endpoint
async def update_key(
    request: Request, services: Services, key_id: str, limits: chat.Limits
) -> Response:
    """Change a key's limits or budgets: the fields sent change, null clears one."""
    auth = services.auth
    auth.require_admin(await auth.authenticate(request.headers, client_identity(request)))
    _, body = await _parse(request, UpdateKey, limits.max_body_bytes)
    return chat.json_response(await auth.keys.update(key_id, body))


@endpoint
async def revoke_key(request: Request, services: Services, key_id: str) -> Response:
    auth = services.auth
    auth.require_admin(await auth.authenticate(request.headers, client_identity(request)))
    return chat.json_response(await auth.keys.revoke(key_id))
