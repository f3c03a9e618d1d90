"""`POST /v1/embeddings`: passed to an OpenAI-compatible upstream as sent, or served by `minilm`,
the all-MiniLM-L6-v2 (int8 ONNX) the gateway ships for context compression.

Either way the request is logged, traced and counted against the key as a chat request is
(accounting.py); passing through goes through the router's retries, fallbacks and breakers, to the
model's OpenAI-compatible deployments.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from flashstack.gateway import accounting, chat
from flashstack.gateway.accounting import Accounting, usage_of
from flashstack.gateway.compress import Compressor
from flashstack.gateway.core import ErrorKind, GatewayError, Usage, invalid_request
from flashstack.gateway.providers.openai_compat import OpenAICompatProvider
from flashstack.gateway.routing import Deployment, Router, RouteTrace

if TYPE_CHECKING:
    from flashstack.gateway.services import Services

MINILM = "minilm"
MINILM_DIMENSIONS = 384
MINILM_DESCRIPTION = "all-MiniLM-L6-v2 (int8 ONNX, in process): 384-dimensional text embeddings"
_MINILM_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions"})
MAX_INPUTS = 2048  # what api.openai.com takes in one request


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


OPERATION = "embeddings"  # the GenAI operation name


async def handle(request: Request, services: Services, limits: chat.Limits) -> Response:
    """One embeddings request; every failure is an OpenAI error body."""
    return await accounting.serve(
        request,
        services,
        OPERATION,
        lambda acct: _serve(acct, services.router, services.compressor, limits),
    )


async def _serve(
    acct: Accounting, router: Router, compressor: Compressor, limits: chat.Limits
) -> Response:
    await acct.authenticate()
    body = await chat.read_json(acct.request, limits.max_body_bytes)
    req = _parse(body)
    if req.model in router.groups:
        if not any(_serves(d) for d in router.deployments(req.model)):
            raise invalid_request(
                f"model {req.model!r} has no OpenAI-compatible deployment, and only those serve "
                f"embeddings; use {MINILM!r} or an OpenAI-compatible embedding model",
                "model",
            )
        creq = await acct.admit(req.model, req.input, 1)
        trace = acct.trace
        reply = await router.call(
            creq, trace, OPERATION, _serves, lambda dep: _forward(dep, body, trace)
        )
        if isinstance(reply, dict) and "model" in reply:
            reply["model"] = req.model
        await acct.finish(trace.usage)
        return chat.json_response(reply)
    if req.model == MINILM:
        await acct.admit(MINILM, req.input, 1)
        acct.trace.served_by = MINILM  # in process: no deployment, no router
        out = await _minilm(compressor, req)
        await acct.finish(Usage(input_tokens=out["usage"]["prompt_tokens"]))
        # What minilm has no use for (user, a newer field) is named, not silently ignored.
        dropped = sorted(k for k in body if k not in _MINILM_FIELDS)
        headers = {"x-flashstack-dropped": ",".join(dropped)} if dropped else None
        return chat.json_response(out, headers=headers)
    known = ", ".join([*router.model_names(), MINILM])
    raise GatewayError(
        ErrorKind.NOT_FOUND,
        f"model {req.model!r} does not exist; available models: {known}",
        param="model",
        code="model_not_found",
    )


def _parse(body: Any) -> EmbeddingsRequest:
    return chat.parse_object(EmbeddingsRequest, body)


def _serves(dep: Deployment) -> bool:
    return isinstance(dep.provider, OpenAICompatProvider)


async def _forward(dep: Deployment, body: dict[str, Any], trace: RouteTrace) -> Any:
    provider: OpenAICompatProvider = dep.provider  # type: ignore[assignment]
    reply = await provider.forward("/embeddings", {**body, "model": dep.cfg.model})
    trace.usage = usage_of(reply)
    return reply


async def _minilm(compressor: Compressor, req: EmbeddingsRequest) -> dict[str, Any]:
    texts = [req.input] if isinstance(req.input, str) else req.input
    if not texts or not all(isinstance(t, str) for t in texts):
        raise invalid_request(
            f"{MINILM} takes text: input must be a string or a non-empty list of strings "
            "(token arrays are another tokenizer's ids)",
            "input",
        )
    if len(texts) > MAX_INPUTS:
        raise invalid_request(
            f"input has {len(texts)} texts; at most {MAX_INPUTS} per request", "input"
        )
    if any(not t for t in texts):
        raise invalid_request("input must not contain empty strings", "input")
    if req.dimensions is not None and req.dimensions != MINILM_DIMENSIONS:
        raise invalid_request(
            f"{MINILM} embeddings have {MINILM_DIMENSIONS} dimensions and cannot be shortened; "
            "leave dimensions out",
            "dimensions",
        )
    vectors, counts = await compressor.embed_texts(texts)  # type: ignore[arg-type]
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    used = sum(counts)
    return {
        "object": "list",
        "data": data,
        "model": MINILM,
        "usage": {"prompt_tokens": used, "total_tokens": used},
    }


def _encoded(vector: Any, encoding: str) -> Any:
    # little-endian float32, as api.openai.com sends it (and the SDK decodes it)
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
