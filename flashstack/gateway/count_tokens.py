"""`POST /v1/messages/count_tokens`: what a Messages request would cost its model in input tokens.

The deployment the request would be routed to counts: an Anthropic upstream answers it itself (the
body forwarded as sent, the model renamed); a deployment with its own tokenizer (a local model's,
or a `tokenizer` naming the GGUF or model directory its upstream serves) counts with it and its
chat template, as the upstream would render the prompt; any other says it cannot count.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from flashstack.gateway import chat, tokens
from flashstack.gateway.auth import may_use
from flashstack.gateway.config import ModelConfig
from flashstack.gateway.core import ChatRequest, ErrorKind, GatewayError, invalid_request
from flashstack.gateway.providers.anthropic import AnthropicProvider
from flashstack.gateway.providers.usage import own_tokenizer, template_tokens
from flashstack.gateway.routing import Router
from flashstack.gateway.sessions import hooks as session_hooks
from flashstack.gateway.translate import fields

if TYPE_CHECKING:
    from flashstack.gateway.services import Services

log = logging.getLogger("flashstack.gateway")
# count_tokens takes a Messages body without max_tokens; validation needs one, the
# upstream does not.
_PLACEHOLDER_MAX_TOKENS = 1


async def handle(request: Request, services: Services, limits: chat.Limits) -> Response:
    """Serve one count; every failure an Anthropic error."""
    wire = chat.ANTHROPIC
    try:
        caller = await session_hooks.authenticate(request, services.auth)
        body = await chat.read_json(request, limits.max_body_bytes)
        req = _parse(body, limits)
        if not may_use(caller, req.model):
            raise GatewayError(
                ErrorKind.NOT_FOUND,
                f"model {req.model!r} does not exist",
                param="model",
                code="model_not_found",
            )
        req.headers = fields.client_headers(request.headers)
        counted = await count(services.router, req)
        return chat.json_response(counted, headers=fields.response_headers(req) or None)
    except GatewayError as e:
        return chat.error_response(wire, e)
    except Exception:
        log.exception("unexpected error counting tokens")
        return chat.error_response(
            wire, GatewayError(ErrorKind.INTERNAL, "internal error; see the gateway log")
        )


def _parse(body: Any, limits: chat.Limits) -> ChatRequest:
    if isinstance(body, dict) and "max_tokens" not in body:
        req = chat.parse(
            chat.ANTHROPIC, {**body, "max_tokens": _PLACEHOLDER_MAX_TOKENS}, limits.max_json_depth
        )
        req.extra.pop("max_tokens", None)
        return req
    return chat.parse(chat.ANTHROPIC, body, limits.max_json_depth)


async def count(router: Router, req: ChatRequest) -> dict[str, Any]:
    """{"input_tokens": n} from the deployment the request would be routed to."""
    # Of several deployments of one name, the router's first choice (first in config order that
    # is not cooling down, healthy first): one answer every time, from the upstream that serves.
    dep = await router.first_choice(req.model)  # 404 for an unknown model
    if isinstance(dep.provider, AnthropicProvider):
        return await dep.provider.count_tokens(req)
    if tokens.tokenizer_path(dep.cfg) is not None:  # in a thread: a tokenizer may load
        return {"input_tokens": await asyncio.to_thread(_own_count, dep.cfg, req)}
    raise invalid_request(
        f"token counting is not available for model {req.model!r} (deployment {dep.id!r}, served "
        f"by {dep.cfg.provider}): only Anthropic upstreams, local models and deployments that "
        "name their model's `tokenizer` count tokens",
        "model",
    )


def _own_count(cfg: ModelConfig, req: ChatRequest) -> int:
    """`req`'s prompt tokens by the model's own tokenizer and chat template, tools included."""
    tokenizer = own_tokenizer(cfg)
    if tokenizer is None:
        raise invalid_request(
            f"model {req.model!r} has no tokenizer with a chat template to count with; check its "
            "deployment's `tokenizer` (the gateway log says why it could not be loaded)",
            "model",
        )
    try:
        return template_tokens(tokenizer, req)
    except GatewayError:
        raise
    except Exception as e:  # the template's own refusal (its raise_exception)
        raise invalid_request(
            f"the chat template of model {req.model!r} cannot render this request: {e}", "messages"
        ) from None
