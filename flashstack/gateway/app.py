"""HTTP routes. Each route parses, calls one function, and returns; logic lives elsewhere."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from flashstack.config import Config
from flashstack.gateway import chat
from flashstack.gateway.core import ErrorKind, GatewayError
from flashstack.gateway.router import Router

_STARTED = int(time.time())


def create_app(config: Config, router: Router | None = None) -> FastAPI:
    """The gateway's ASGI app for `config`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.router = router or Router(config.models)
        yield
        await app.state.router.aclose()

    app = FastAPI(title="flashstack gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    limits = chat.Limits(
        config.server.max_body_bytes, config.server.stream_queue_size, config.server.stream_ping_interval
    )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await chat.handle(chat.OPENAI, request, request.app.state.router, limits)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await chat.handle(chat.ANTHROPIC, request, request.app.state.router, limits)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        return chat.json_response(models_json(request.app.state.router))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> Response:
        router: Router = request.app.state.router
        if model_id not in router.groups:
            err = GatewayError(ErrorKind.NOT_FOUND, f"model {model_id!r} does not exist", param="model")
            return chat.error_response(_wire_of(request), err)
        return chat.json_response(model_json(model_id, router))

    @app.get("/health/liveness")
    async def liveness() -> Response:
        return chat.json_response({"status": "ok"})

    @app.get("/health/readiness")
    async def readiness(request: Request) -> Response:
        report = await request.app.state.router.readiness()
        ready = all(any(d["ok"] for d in deps) for deps in report.values()) if report else False
        return chat.json_response({"status": "ready" if ready else "degraded", "models": report}, 200 if ready else 503)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = ErrorKind.NOT_FOUND if exc.status_code == 404 else ErrorKind.INVALID_REQUEST
        err = GatewayError(kind, f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code)
        return chat.error_response(_wire_of(request), err)

    return app


def _wire_of(request: Request) -> chat.WireFormat:
    is_anthropic = request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers
    return chat.ANTHROPIC if is_anthropic else chat.OPENAI


def model_json(name: str, router: Router) -> dict[str, object]:
    """One model, readable by both SDKs: OpenAI's Model and Anthropic's ModelInfo fields."""
    cfg = router.config_of(name)
    return {
        "id": name,
        "object": "model",
        "created": _STARTED,
        "owned_by": cfg.provider,
        "type": "model",
        "display_name": cfg.description or name,
        "created_at": datetime.fromtimestamp(_STARTED, UTC).isoformat().replace("+00:00", "Z"),
    }


def models_json(router: Router) -> dict[str, object]:
    data = [model_json(name, router) for name in router.model_names()]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": False,
    }
