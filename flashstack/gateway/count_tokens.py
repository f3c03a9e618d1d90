"""`POST /v1/messages/count_tokens`: what a Messages request would cost its model in input tokens.

Anthropic upstreams answer it themselves (the body forwarded as sent, the model renamed); a local
model counts with its own tokenizer and chat template; any other model says it cannot count.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from flashstack.gateway import chat
from flashstack.gateway.auth import may_use
from flashstack.gateway.config import ModelConfig
from flashstack.gateway.core import ChatRequest, ErrorKind, GatewayError, invalid_request
from flashstack.gateway.providers.anthropic import AnthropicProvider
from flashstack.gateway.routing import Router
from flashstack.gateway.sessions import hooks as session_hooks
from flashstack.gateway.translate import fields

log = logging.getLogger("flashstack.gateway")
# count_tokens takes a Messages body without max_tokens; validation needs one, the upstream does not.
_PLACEHOLDER_MAX_TOKENS = 1


async def handle(request: Request, router: Router, limits: chat.Limits) -> Response:
    """Serve one count; every failure an Anthropic error."""
    wire = chat.ANTHROPIC
    try:
        caller = await session_hooks.authenticate(request)
        body = await chat.read_json(request, limits.max_body_bytes)
        req = _parse(body, limits)
        if not may_use(caller, req.model):
            raise GatewayError(ErrorKind.NOT_FOUND, f"model {req.model!r} does not exist", param="model",
                               code="model_not_found")
        req.headers = fields.client_headers(request.headers)
        counted = await count(router, req)
        return chat.json_response(counted, headers=fields.response_headers(req) or None)
    except GatewayError as e:
        return chat.error_response(wire, e)
    except Exception:
        log.exception("unexpected error counting tokens")
        return chat.error_response(wire, GatewayError(ErrorKind.INTERNAL, "internal error; see the gateway log"))


def _parse(body: Any, limits: chat.Limits) -> ChatRequest:
    if isinstance(body, dict) and "max_tokens" not in body:
        req = chat.parse(chat.ANTHROPIC, {**body, "max_tokens": _PLACEHOLDER_MAX_TOKENS}, limits.max_json_depth)
        req.extra.pop("max_tokens", None)
        return req
    return chat.parse(chat.ANTHROPIC, body, limits.max_json_depth)


async def count(router: Router, req: ChatRequest) -> dict[str, Any]:
    """{"input_tokens": n} from the model's first deployment that can count."""
    deployments = router.deployments(req.model)  # 404 for an unknown model
    for dep in deployments:
        if isinstance(dep.provider, AnthropicProvider):
            return await dep.provider.count_tokens(req)
    for dep in deployments:
        if dep.cfg.provider == "local":
            return {"input_tokens": _local_count(dep.cfg, req)}
    providers = ", ".join(sorted({d.cfg.provider for d in deployments}))
    raise invalid_request(
        f"token counting is not available for model {req.model!r} (served by {providers}): only Anthropic "
        "upstreams and local models count tokens", "model")


def _local_count(cfg: ModelConfig, req: ChatRequest) -> int:
    from flashstack.gateway.providers.local import chat_messages

    tokenizer = _tokenizer(cfg.model)
    if tokenizer is None:
        raise invalid_request(f"local model {req.model!r} has no tokenizer to count with", "model")
    return len(tokenizer.encode_chat(chat_messages(req)))


@functools.cache
def _tokenizer(model_dir: str) -> Any:
    try:
        from flashstack.engine.tokenizer import Tokenizer

        return Tokenizer(model_dir)
    except Exception:  # no tokenizer files: the caller says so in the client's terms
        return None
