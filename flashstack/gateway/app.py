"""HTTP routes. Each route parses, calls one function, and returns; logic lives elsewhere."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from flashstack.gateway import chat, completions, count_tokens, embeddings, responses, spend
from flashstack.gateway.auth import ANONYMOUS, Caller, may_use
from flashstack.gateway.browser_guard import BrowserGuard
from flashstack.gateway.config import Config
from flashstack.gateway.core import ErrorKind, GatewayError
from flashstack.gateway.routing import Router
from flashstack.gateway.services import Services, ServicesApp
from flashstack.gateway.sessions import api as sessions_api
from flashstack.gateway.sessions import hooks as session_hooks
from flashstack.gateway.spend import SpendStore
from flashstack.gateway.telemetry import Tracing
from flashstack.gateway.tls import ServerTLS
from flashstack.gateway.ui.routes import add_console_routes

_STARTED = int(time.time())
log = logging.getLogger("flashstack.gateway")


def create_app(
    config: Config,
    router: Router | None = None,
    tracing: Tracing | None = None,
    tls: ServerTLS | None = None,
) -> FastAPI:
    """The gateway's ASGI app for `config` (`tracing`: spans go there instead of telemetry's
    exporter; `tls`: the server TLS `serve` listens with, for readiness)."""

    @asynccontextmanager
    async def lifespan(app: GatewayApp) -> AsyncIterator[None]:
        app.services = await Services.start(config, router, tracing, tls)
        # Everything loaded so far lives as long as the process: out of the collector's sight, a
        # full collection scans only what requests allocate (it took ~65 ms, the p99 under load).
        gc.collect()
        gc.freeze()
        yield
        await app.services.aclose()

    app = GatewayApp(title="flashstack gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.browser_guard = BrowserGuard.from_config(config)
    limits = chat.Limits(
        config.server.max_body_bytes,
        config.server.stream_queue_size,
        config.server.stream_ping_interval,
        vision=config.vision,
        max_json_depth=config.server.max_json_depth,
    )

    _add_session_routes(app, limits)
    add_console_routes(app, config)  # /ui: the operator's console (master key only)

    async def chat_completions(request: Request) -> Response:
        return await chat.handle(chat.OPENAI, request, app.services, limits)

    async def messages(request: Request) -> Response:
        return await chat.handle(chat.ANTHROPIC, request, app.services, limits)

    # Plain Starlette routes (other methods get their 405 there), and served straight from
    # GatewayApp.__call__ when POSTed: these handlers use none of the middleware and catch their
    # own errors.
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/messages", messages, methods=["POST"])
    _add_responses_routes(app, limits)

    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request) -> Response:
        return await embeddings.handle(request, app.services, limits)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await completions.handle(request, app.services, limits)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request) -> Response:
        return await count_tokens.handle(request, app.services, limits)

    app.chat_routes = {
        **app.chat_routes,
        "/v1/chat/completions": chat_completions,
        "/v1/messages": messages,
    }

    # With auth on, every route but liveness needs a key (401 in the caller's format, by the handler
    # of GatewayError below); a key limited to some models sees only those.
    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        caller = await session_hooks.authenticate(request, app.services.auth)
        return chat.json_response(models_json(app.services.router, caller))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> Response:
        caller = await session_hooks.authenticate(request, app.services.auth)
        router: Router = app.services.router
        listed = model_id in router.groups or model_id == embeddings.MINILM
        if not listed or not may_use(caller, model_id):
            err = GatewayError(
                ErrorKind.NOT_FOUND,
                f"model {model_id!r} does not exist",
                param="model",
                code="model_not_found",
            )
            return chat.error_response(_wire_of(request), err)
        return chat.json_response(model_json(model_id, router))

    @app.get("/health/liveness")
    async def liveness() -> Response:
        return chat.json_response({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        await session_hooks.authenticate(request, app.services.auth)
        body = await app.services.router.render_metrics()
        body += app.services.compressor.render_metrics()  # flashstack_compression_*
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health/readiness")
    async def readiness(request: Request) -> Response:
        caller = await session_hooks.authenticate(request, app.services.auth)
        report = await app.services.router.readiness()
        ready = all(any(d["ok"] for d in deps) for deps in report.values()) if report else False
        body: dict[str, object] = {"models": report}
        tls = app.services.tls  # the ServerTLS `serve` listens with
        # a renewal failing is a warning; only an expired certificate is unready
        if tls is not None:
            body["tls"] = tls_report = tls.status()
            ready = ready and tls_report["status"] != "expired"
        compression = app.services.compressor.state  # idle | loading | ready | failed
        body["compression"] = states = {"embedding_model": compression}
        ready = ready and compression != "loading"  # failed: requests are truncated, still served
        if (summarizer := app.services.compressor.summarizer_state) is not None:
            states["summarizer"] = summarizer  # failed: summaries stay extractive
            ready = ready and summarizer != "loading"
        # Deployment ids and probe errors name upstreams: the detail is the master
        # key's (or auth off).
        detail = body if caller.admin or caller == ANONYMOUS else {}
        return chat.json_response(
            {"status": "ready" if ready else "degraded", **detail}, 200 if ready else 503
        )

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        return chat.error_response(_wire_of(request), exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:  # an unknown route, not a model: no model_not_found
            err = GatewayError(
                ErrorKind.NOT_FOUND,
                f"{request.method} {request.url.path} is not a route of this "
                "gateway (it serves /v1/chat/completions, /v1/messages, /v1/responses, /v1/models, "
                "/v1/sessions)",
                code="not_found",
            )
        else:
            err = GatewayError(
                ErrorKind.INVALID_REQUEST,
                f"{request.method} {request.url.path}: {exc.detail}",
                status=exc.status_code,
            )
        return chat.error_response(_wire_of(request), err)

    return app


class GatewayApp(ServicesApp):
    """FastAPI, except that POSTs to the chat endpoints skip its middleware stack and route table.

    Those layers (error and exception middleware, telemetry and body-limit hooks, exit stack, a
    regex per route) cost ~15 % of a chat request's CPU (docs/benchmarks.md, "Gateway overhead"),
    and chat.handle needs none of them: it turns every failure into a response itself.
    """

    chat_routes: dict[str, Callable[[Request], Awaitable[Response]]] = {}
    # auth off: foreign Host / Origin refused (browser_guard.py)
    browser_guard: BrowserGuard | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.browser_guard is not None:
            refusal = self.browser_guard.check(scope)
            if refusal is not None:
                await chat.error_response(_wire_of(Request(scope)), refusal)(scope, receive, send)
                return
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.chat_routes.get(_route_path(scope))
            if handler is not None:
                scope["app"] = self
                if self.root_path:
                    scope["root_path"] = self.root_path
                response = await handler(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path the route table would match: without the root path a proxy mounted us under."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _add_responses_routes(app: GatewayApp, limits: chat.Limits) -> None:
    """The OpenAI Responses API (responses.py): POST served like the chat routes, stored
    ones read back."""

    async def create_response(request: Request) -> Response:
        return await responses.handle(request, app.services, limits)

    app.add_route("/v1/responses", create_response, methods=["POST"])
    app.chat_routes = {**app.chat_routes, "/v1/responses": create_response}

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> Response:
        return await responses.get_response(request, app.services, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Response:
        return await responses.delete_response(request, app.services, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request) -> Response:
        return await responses.list_input_items(request, app.services, response_id)


def _add_session_routes(app: GatewayApp, limits: chat.Limits) -> None:
    """`/v1/sessions` (OpenAI Conversations-shaped) and `/v1/keys` (master key only)."""

    @app.post("/v1/sessions")
    async def create_session(request: Request) -> Response:
        return await sessions_api.create_session(request, app.services, limits)

    @app.get("/v1/sessions")
    async def list_sessions(request: Request) -> Response:
        return await sessions_api.list_sessions(request, app.services)

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> Response:
        return await sessions_api.get_session(request, app.services, session_id)

    @app.post("/v1/sessions/{session_id}")
    async def update_session(session_id: str, request: Request) -> Response:
        return await sessions_api.update_session(request, app.services, session_id, limits)

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, request: Request) -> Response:
        return await sessions_api.delete_session(request, app.services, session_id)

    @app.post("/v1/sessions/{session_id}/messages")
    async def post_session_message(session_id: str, request: Request) -> Response:
        return await sessions_api.post_message(request, app.services, session_id, limits)

    @app.get("/v1/sessions/{session_id}/messages")
    async def list_session_messages(session_id: str, request: Request) -> Response:
        return await sessions_api.list_messages(request, app.services, session_id)

    @app.post("/v1/keys")
    async def create_key(request: Request) -> Response:
        return await sessions_api.create_key(request, app.services, limits)

    @app.get("/v1/keys")
    async def list_keys(request: Request) -> Response:
        return await sessions_api.list_keys(request, app.services)

    @app.post("/v1/keys/{key_id}")
    async def update_key(key_id: str, request: Request) -> Response:
        return await sessions_api.update_key(request, app.services, key_id, limits)

    @app.delete("/v1/keys/{key_id}")
    async def revoke_key(key_id: str, request: Request) -> Response:
        return await sessions_api.revoke_key(request, app.services, key_id)

    @app.get("/v1/keys/{key_id}/spend")
    async def key_spend(key_id: str, request: Request) -> Response:
        """The master key sees every key's spend; a key sees its own."""
        caller = await session_hooks.authenticate(request, app.services.auth)
        auth = app.services.auth
        if not caller.admin and caller.key_id != key_id:
            auth.require_admin(caller)
        key = await auth.keys.get(key_id)
        if key is None:
            raise GatewayError(
                ErrorKind.NOT_FOUND, f"API key {key_id!r} does not exist", param="key_id"
            )
        await app.services.requests.flush()  # rows still in the write buffer count too
        return chat.json_response(await spend.key_spend(SpendStore(auth.keys.db), key))


def _wire_of(request: Request) -> chat.WireFormat:
    is_anthropic = (
        request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers
    )
    return chat.ANTHROPIC if is_anthropic else chat.OPENAI


def model_json(name: str, router: Router) -> dict[str, object]:
    """One model, readable by both SDKs: OpenAI's Model and Anthropic's ModelInfo fields."""
    if name == embeddings.MINILM and name not in router.groups:  # in process, not configured
        owner, display = "flashstack", embeddings.MINILM_DESCRIPTION
    else:
        cfg = router.config_of(name)
        owner, display = cfg.provider, cfg.description or name
    return {
        "id": name,
        "object": "model",
        "created": _STARTED,
        "owned_by": owner,
        "type": "model",
        "display_name": display,
        "created_at": datetime.fromtimestamp(_STARTED, UTC).isoformat().replace("+00:00", "Z"),
    }


def models_json(router: Router, caller: Caller = ANONYMOUS) -> dict[str, object]:
    names = [
        *router.model_names(),
        *([embeddings.MINILM] if embeddings.MINILM not in router.groups else []),
    ]
    data = [model_json(name, router) for name in names if may_use(caller, name)]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": False,
    }
