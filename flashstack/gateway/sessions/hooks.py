"""What the chat endpoints call: authenticate the caller, and join the session a request names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from flashstack.gateway.auth import Auth, Caller
from flashstack.gateway.compress.options import shift_pinned
from flashstack.gateway.core import ChatRequest, invalid_request
from flashstack.gateway.sessions import codec
from flashstack.gateway.sessions.turns import Idempotency, Turn
from flashstack.gateway.tls import client_identity

if TYPE_CHECKING:
    from flashstack.gateway.services import Services

SESSION_HEADER = "x-session-id"


async def authenticate(request: Request, auth: Auth) -> Caller:
    """The caller (401 when auth is on and the key is missing, unknown, revoked or expired)."""
    return await auth.authenticate(request.headers, client_identity(request))


async def begin_turn(
    services: Services, request: Request, req: ChatRequest, caller: Caller, body: Any
) -> Turn:
    """Admit the request (403/429, its tokens held against the key's tpm) and, with `X-Session-Id`
    or `metadata.session_id`, lock that session and prepend its history (404 if it is not the
    caller's, 413 if a message is over store.max_message_bytes)."""
    auth, sessions = services.auth, services.sessions
    auth.check_model(caller, req.model)
    session_id = request.headers.get(SESSION_HEADER) or req.metadata.get("session_id")
    if not session_id:
        turn = Turn(sessions, caller)
        await turn.admit(auth, req)
        return turn
    if not isinstance(session_id, str):
        raise invalid_request("metadata.session_id must be a string", "metadata.session_id")
    idem = Idempotency.of(request.headers, request.url.path + "\0" + session_id, body)
    turn = await sessions.open_turn(caller, session_id, list(req.messages), idem, req.wire)
    # Stored from the other wire, a message's wire-only fields cannot go: named in
    # x-flashstack-dropped.
    history = codec.for_wire(turn.history, req.wire, req.exchange.dropped)
    req.messages = history + req.messages
    shift_pinned(req, len(history))  # `compression.pinned` keeps naming the caller's own messages
    if not req.system:
        req.system = turn.system()
    await turn.admit(auth, req)  # after the history is known: it is part of what the request costs
    return turn
