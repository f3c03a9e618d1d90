"""The bookkeeping around a request that is not a chat (embeddings, legacy completions), as chat.py
does it for a chat: the request log and its trace, the key's models, rate limits and budget.

`serve` runs a handler with an `Accounting` and ends the request-log record when the response (a
stream: its last event) has gone out; every failure is an OpenAI error body.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from flashstack.gateway import chat, tokens
from flashstack.gateway.auth import ANONYMOUS, UNLIMITED, Auth, Caller, Reservation
from flashstack.gateway.core import ChatRequest, ErrorKind, GatewayError, Message, Text, Usage
from flashstack.gateway.requestlog import RequestRecord
from flashstack.gateway.routing import RouteTrace
from flashstack.gateway.sessions import hooks as session_hooks
from flashstack.gateway.streaming import EventStream

if TYPE_CHECKING:
    from flashstack.gateway.services import Services

log = logging.getLogger("flashstack.gateway")


@dataclass(eq=False)
class Accounting:
    """One request's caller, its log record and trace, and what it holds against its key."""

    request: Request
    auth: Auth
    trace: RouteTrace
    record: RequestRecord
    operation: str  # "embeddings" | "text_completion" (GenAI operation names)
    caller: Caller = ANONYMOUS
    reservation: Reservation = UNLIMITED
    output_bytes: int = 0  # streamed out so far: what a stream cut short is charged by

    async def authenticate(self) -> Caller:
        """The caller (401 when auth is on and the key is not valid)."""
        self.caller = await session_hooks.authenticate(self.request, self.auth)
        self.record.key_id = self.caller.key_id
        return self.caller

    async def admit(
        self,
        model: str,
        prompt: str | list[str] | list[int] | list[list[int]],
        max_tokens: int,
        stream: bool = False,
    ) -> ChatRequest:
        """Count the request against the key (403 for a model it may not use, 429 over its limits or
        budget), holding what it may cost; the canonical request that the router and spans see."""
        req = ChatRequest(
            model=model,
            messages=[Message("user", [Text(_text_of(prompt))])],
            max_tokens=max_tokens,
            stream=stream,
        )
        self.record.request(req, operation=self.operation)
        self.auth.check_model(self.caller, model)
        self.reservation = await self.auth.admit(self.caller, req)
        self.record.charged = self.reservation.budget
        return req

    async def finish(self, usage: Usage | None) -> None:
        """Settle the key's holds with the reply's usage (its estimate when the
        upstream gave none)."""
        if usage is not None:
            self.trace.usage = usage
        self.reservation.served_by = self.trace.served_by
        await self.reservation.finish(usage or Usage(), self.output_bytes)

    async def abandon(self) -> None:
        """Settle a request that ended without usage (free unless output had gone out)."""
        await self.reservation.abandon(self.output_bytes)

    async def settled(
        self, chunks: AsyncIterator[bytes], usage: Callable[[], Usage | None]
    ) -> AsyncIterator[bytes]:
        """`chunks`, counted as they go out; at their end the holds settle with `usage()`, or, cut
        short (the client left, the upstream broke off), as abandoned."""
        done = False
        try:
            async for chunk in chunks:
                self.output_bytes += len(chunk)
                yield chunk
            done = True
        finally:
            if done:
                await self.finish(usage())
            else:
                await self.abandon()


def _text_of(prompt: str | list[str] | list[int] | list[list[int]]) -> str:
    """The prompt as the text the key's limits are estimated from (a token id as
    BYTES_PER_TOKEN bytes)."""
    if isinstance(prompt, str):
        return prompt
    per_token = math.ceil(tokens.BYTES_PER_TOKEN)
    parts = [
        p if isinstance(p, str) else "x" * (per_token * (len(p) if isinstance(p, list) else 1))
        for p in prompt
    ]
    return "\n".join(parts)


def usage_of(reply: Any) -> Usage | None:
    """The usage an OpenAI-compatible embeddings or completions body reports, if it does."""
    u = reply.get("usage") if isinstance(reply, dict) else None
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    cached = _count(details, "cached_tokens") if isinstance(details, dict) else 0
    # Canonical input tokens exclude the cached ones (core.Usage); OpenAI's
    # prompt_tokens include them.
    return Usage(
        input_tokens=max(0, _count(u, "prompt_tokens") - cached),
        output_tokens=_count(u, "completion_tokens"),
        cache_read_input_tokens=cached,
    )


def _count(fields: dict[str, Any], name: str) -> int:
    v = fields.get(name)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


Handler = Callable[[Accounting], Awaitable[Response]]


async def serve(request: Request, services: Services, operation: str, handler: Handler) -> Response:
    """Run `handler` with the request's accounting; the request log gets the request
    when it ends."""
    trace = RouteTrace.from_header(request.headers.get("x-request-id"))
    requests = services.requests
    record = requests.begin(
        trace, chat.OPENAI.name, request.method, request.url.path, request.headers
    )
    acct = Accounting(request, services.auth, trace, record, operation)
    try:
        response = await handler(acct)
    except GatewayError as e:
        record.error = e.message
        await acct.abandon()
        response = chat.error_response(chat.OPENAI, e, trace.headers())
    except ClientDisconnect:
        await acct.abandon()
        response = Response(status_code=499)
    except Exception:
        log.exception("unexpected error serving a %s request", operation)
        await acct.abandon()
        response = chat.error_response(
            chat.OPENAI, GatewayError(ErrorKind.INTERNAL, "internal error; see the gateway log")
        )
    response.headers.update(trace.headers())
    dropped = response.headers.get("x-flashstack-dropped")
    if isinstance(response, EventStream):
        response.background = BackgroundTask(requests.end, record, 200, None, dropped)
    else:
        await requests.end(record, response.status_code, dropped=dropped)
    return response
