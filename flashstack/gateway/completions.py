"""Legacy `POST /v1/completions` (a raw prompt, no chat template): passed to an OpenAI-compatible
upstream as sent, or run on the local engine.

A completion is logged, traced and counted against the key as a chat request is (accounting.py),
and goes through the router's retries, fallbacks and breakers to the deployments that can serve it
(OpenAI-compatible or local); a stream may move to another deployment until its first event, and
its attempt lasts until its last.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from flashstack.gateway import accounting, chat
from flashstack.gateway.accounting import Accounting, usage_of
from flashstack.gateway.core import (
    ChatRequest,
    Error,
    Event,
    Finish,
    GatewayError,
    StopReason,
    TextDelta,
    Usage,
    invalid_request,
)
from flashstack.gateway.providers.local import LocalProvider
from flashstack.gateway.providers.openai_compat import OpenAICompatProvider
from flashstack.gateway.routing import Deployment, Router, RouteTrace
from flashstack.gateway.streaming import EventStream, pulled
from flashstack.gateway.translate.openai import FINISH_REASON, error_json
from flashstack.gateway.wire.openai import SSE_DONE, sse_event, usage_body

if TYPE_CHECKING:
    from flashstack.gateway.services import Services

DEFAULT_MAX_TOKENS = 16  # the API's default for completions
# Fields the local engine honours; refused ones change what comes back, dropped ones only how.
_LOCAL_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "stream",
        "seed",
        "stream_options",
        "n",
    }
)
_LOCAL_REFUSED = {
    "echo": "the prompt is not echoed",
    "logprobs": "no log-probabilities",
    "suffix": "no insertion",
    "best_of": "one completion only",
    "logit_bias": "tokens cannot be biased",
}
_HARMLESS: dict[str, tuple[Any, ...]] = {
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "logit_bias": ({},),
}


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: int | None = Field(default=None, ge=1, le=128)
    stop: str | list[str] | None = None
    stream: bool | None = False
    seed: int | None = None
    stream_options: dict[str, Any] | None = None


OPERATION = "text_completion"  # the GenAI operation name


async def handle(request: Request, services: Services, limits: chat.Limits) -> Response:
    return await accounting.serve(
        request, services, OPERATION, lambda acct: _serve(acct, services.router, limits)
    )


async def _serve(acct: Accounting, router: Router, limits: chat.Limits) -> Response:
    await acct.authenticate()
    body = await chat.read_json(acct.request, limits.max_body_bytes)
    req = _parse(body)
    _deployment(router, req.model)  # 404 for an unknown model, 400 for a chat-only one
    creq = await acct.admit(
        req.model, req.prompt, req.max_tokens or DEFAULT_MAX_TOKENS, bool(req.stream)
    )
    # the serving one adds its own
    headers: dict[str, str] = {"cache-control": "no-cache"} if req.stream else {}
    if not req.stream:
        reply = await router.call(
            creq,
            acct.trace,
            OPERATION,
            _serves,
            lambda dep: _whole(acct.trace, dep, req, body, headers),
        )
        await acct.finish(acct.trace.usage)
        return chat.json_response(reply, headers=headers or None)
    chunks = await router.open_call(
        creq,
        acct.trace,
        OPERATION,
        _serves,
        lambda dep: _streamed(acct.trace, dep, req, body, headers),
    )
    return EventStream(
        acct.settled(_ended_by_error(chunks, acct.trace), lambda: acct.trace.usage),
        media_type="text/event-stream",
        headers=headers,
    )


async def _whole(
    trace: RouteTrace,
    dep: Deployment,
    req: CompletionRequest,
    body: dict[str, Any],
    headers: dict[str, str],
) -> Any:
    if isinstance(dep.provider, OpenAICompatProvider):
        return await _forward(trace, dep, req, body)
    return await _local(trace, dep, req, body, headers)


def _streamed(
    trace: RouteTrace,
    dep: Deployment,
    req: CompletionRequest,
    body: dict[str, Any],
    headers: dict[str, str],
) -> AsyncIterator[bytes]:
    """The SSE lines a deployment streams; the router takes the first (a failure before
    it moves on)."""
    if isinstance(dep.provider, OpenAICompatProvider):
        return _forward_stream(trace, dep, req, body)
    return _local_stream(trace, dep, req, body, headers)


async def _ended_by_error(chunks: AsyncIterator[bytes], trace: RouteTrace) -> AsyncIterator[bytes]:
    """`chunks`; a failure after the first byte goes out as the stream's last event."""
    try:
        async for chunk in chunks:
            yield chunk
    except GatewayError as e:
        trace.error = e.message
        yield sse_event(error_json(e))


def _parse(body: Any) -> CompletionRequest:
    return chat.parse_object(CompletionRequest, body)


def _serves(dep: Deployment) -> bool:
    return isinstance(dep.provider, OpenAICompatProvider | LocalProvider)


def _deployment(router: Router, model: str) -> Deployment:
    for dep in router.deployments(model):  # 404 for an unknown model
        if _serves(dep):
            return dep
    raise invalid_request(
        f"model {model!r} is served over a chat-only API; /v1/completions needs an "
        "OpenAI-compatible or local model (or send it to /v1/chat/completions)",
        "model",
    )


# ---- an OpenAI-compatible upstream: the body as sent -----------------------------------------


async def _forward(
    trace: RouteTrace, dep: Deployment, req: CompletionRequest, body: dict[str, Any]
) -> Any:
    provider: OpenAICompatProvider = dep.provider  # type: ignore[assignment]
    reply = await provider.forward("/completions", {**body, "model": dep.cfg.model})
    trace.usage = usage_of(reply)
    if isinstance(reply, dict) and "model" in reply:
        reply["model"] = req.model
    return reply


async def _forward_stream(
    trace: RouteTrace, dep: Deployment, req: CompletionRequest, body: dict[str, Any]
) -> AsyncIterator[bytes]:
    """The upstream's events, `model` renamed to the one the client asked for, and its usage kept
    in `trace` (and taken out, when the client did not ask for it)."""
    provider: OpenAICompatProvider = dep.provider  # type: ignore[assignment]
    asked = bool((req.stream_options or {}).get("include_usage"))
    # Usage is asked for whatever the client asked: it is what the key is charged by.
    sent = {
        **body,
        "model": dep.cfg.model,
        "stream_options": {**(req.stream_options or {}), "include_usage": True},
    }
    async for line in provider.forward_stream("/completions", sent):
        if (out := _relayed(line, req.model, asked, trace)) is not None:
            yield out


def _relayed(line: bytes, model: str, include_usage: bool, trace: RouteTrace) -> bytes | None:
    data = line[len(b"data: ") :].strip()
    if data == b"[DONE]":
        return line
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        return line
    if not isinstance(chunk, dict):
        return line
    if chunk.get("usage"):
        trace.usage = usage_of(chunk)
    if not include_usage:
        if chunk.get("usage") and not chunk.get("choices"):
            return None  # the usage-only chunk the gateway asked for
        chunk.pop("usage", None)
    if "model" in chunk:
        chunk["model"] = model
    return sse_event(chunk)


# ---- the local engine ------------------------------------------------------------------------


def _local_request(
    req: CompletionRequest, body: dict[str, Any], headers: dict[str, str]
) -> ChatRequest:
    """The sampling fields the engine takes (400 for a field it cannot honour; the
    dropped ones named)."""
    for name, why in _LOCAL_REFUSED.items():
        value = body.get(name)
        if value is not None and value not in _HARMLESS.get(name, ()):
            raise invalid_request(
                f"{name} cannot be served by local model {req.model!r} ({why}); remove it", name
            )
    if (req.n or 1) > 1:
        raise invalid_request(
            f"local model {req.model!r} returns one completion per request; leave n out", "n"
        )
    dropped = sorted(k for k in body if k not in _LOCAL_FIELDS and k not in _LOCAL_REFUSED)
    if dropped:
        headers["x-flashstack-dropped"] = ",".join(dropped)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return ChatRequest(
        model=req.model,
        messages=[],
        max_tokens=req.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=stop,
        seed=req.seed,
    )


async def _local_events(
    trace: RouteTrace,
    dep: Deployment,
    req: CompletionRequest,
    body: dict[str, Any],
    headers: dict[str, str],
) -> AsyncIterator[Event]:
    """The engine's events for the prompt, its usage kept in `trace` at the Finish."""
    creq = _local_request(req, body, headers)
    provider: LocalProvider = dep.provider  # type: ignore[assignment]
    async for ev in provider.stream_prompt(_one_prompt(req), creq):
        if isinstance(ev, Finish):
            trace.usage = ev.usage
        yield ev


async def _local(
    trace: RouteTrace,
    dep: Deployment,
    req: CompletionRequest,
    body: dict[str, Any],
    headers: dict[str, str],
) -> dict[str, Any]:
    text, finish = [], None
    async for ev in _local_events(trace, dep, req, body, headers):
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        elif isinstance(ev, Finish):
            finish = ev
    assert finish is not None
    return _Encoder(req.model, False).body("".join(text), finish, finish.usage)


async def _local_stream(
    trace: RouteTrace,
    dep: Deployment,
    req: CompletionRequest,
    body: dict[str, Any],
    headers: dict[str, str],
) -> AsyncIterator[bytes]:
    events = _local_events(trace, dep, req, body, headers)
    # a refusal (a prompt too long) raises here: a 400, not a stream's error event
    first = await anext(events)
    encoder = _Encoder(req.model, bool((req.stream_options or {}).get("include_usage")))
    async for chunk in encoder.sse(_chain(first, events)):
        yield chunk


async def _chain(first: Event, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    yield first
    async for ev in rest:
        yield ev


def _one_prompt(req: CompletionRequest) -> str | list[int]:
    p = req.prompt
    if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
        return p  # type: ignore[return-value]
    if isinstance(p, list) and len(p) == 1:
        return p[0]  # type: ignore[return-value]
    raise invalid_request(
        f"local model {req.model!r} takes one prompt per request (a string or token ids)", "prompt"
    )


class _Encoder:
    """`text_completion` bodies and chunks."""

    def __init__(self, model: str, include_usage: bool) -> None:
        self.model, self.include_usage = model, include_usage
        self.id, self.created = "cmpl-" + uuid.uuid4().hex, int(time.time())

    def body(self, text: str, finish: Finish | None, usage: Usage | None) -> dict[str, Any]:
        reason = None if finish is None else _finish_reason(finish.stop_reason)
        out: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}],
        }
        if usage is not None:
            out["usage"] = usage_body(usage.input_tokens, usage.output_tokens)
        return out

    async def sse(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        async for ev in pulled(events):
            if isinstance(ev, TextDelta):
                yield sse_event(self.body(ev.text, None, None))
            elif isinstance(ev, Finish):
                yield sse_event(self.body("", ev, None))
                if self.include_usage:
                    yield sse_event({**self.body("", None, ev.usage), "choices": []})
                yield SSE_DONE
            elif isinstance(ev, Error):
                yield sse_event(error_json(ev.error))


def _finish_reason(stop: StopReason) -> str:
    reason = FINISH_REASON[stop]
    return reason if reason in ("stop", "length") else "stop"
