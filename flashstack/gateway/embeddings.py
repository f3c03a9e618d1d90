"""`POST /v1/embeddings`: passed to an OpenAI-compatible upstream as sent, or served by `minilm`,
the all-MiniLM-L6-v2 (int8 ONNX) the gateway ships for context compression.

Passing through goes to the model's first OpenAI-compatible deployment; embeddings do not take part
in the chat router's retries, fallbacks and breakers.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from flashstack.gateway import chat
from flashstack.gateway.auth import may_use
from flashstack.gateway.compress import Compressor
from flashstack.gateway.core import ErrorKind, GatewayError, invalid_request
from flashstack.gateway.providers.openai_compat import OpenAICompatProvider
from flashstack.gateway.router import Router
from flashstack.gateway.sessions import hooks as session_hooks

MINILM = "minilm"
MINILM_DIMENSIONS = 384
_MINILM_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions"})
MAX_INPUTS = 2048  # what api.openai.com takes in one request


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


async def handle(request: Request, router: Router, compressor: Compressor, limits: chat.Limits) -> Response:
    """One embeddings request; every failure is an OpenAI error body."""
    try:
        caller = await session_hooks.authenticate(request)
        body = await chat.read_json(request, limits.max_body_bytes)
        req = _parse(body)
        if not may_use(caller, req.model):
            raise GatewayError(ErrorKind.PERMISSION, f"this API key may not use model {req.model!r}", param="model")
        if req.model in router.groups:
            return await _forward(router, req.model, body)
        if req.model == MINILM:
            # What minilm has no use for (user, a newer field) is named, not silently ignored.
            dropped = sorted(k for k in body if k not in _MINILM_FIELDS)
            headers = {"x-flashstack-dropped": ",".join(dropped)} if dropped else None
            return chat.json_response(await _minilm(compressor, req), headers=headers)
        known = ", ".join([*router.model_names(), MINILM])
        raise GatewayError(ErrorKind.NOT_FOUND, f"model {req.model!r} does not exist; available models: {known}",
                           param="model", code="model_not_found")
    except GatewayError as e:
        return chat.error_response(chat.OPENAI, e)


def _parse(body: Any) -> EmbeddingsRequest:
    return chat.parse_object(EmbeddingsRequest, body)


async def _forward(router: Router, model: str, body: dict[str, Any]) -> Response:
    for dep in router.deployments(model):
        if isinstance(dep.provider, OpenAICompatProvider):
            reply = await dep.provider.forward("/embeddings", {**body, "model": dep.cfg.model})
            if isinstance(reply, dict) and "model" in reply:
                reply["model"] = model
            return chat.json_response(reply)
    raise invalid_request(f"model {model!r} has no OpenAI-compatible deployment, and only those serve embeddings; "
                          f"use {MINILM!r} or an OpenAI-compatible embedding model", "model")


async def _minilm(compressor: Compressor, req: EmbeddingsRequest) -> dict[str, Any]:
    texts = [req.input] if isinstance(req.input, str) else req.input
    if not texts or not all(isinstance(t, str) for t in texts):
        raise invalid_request(f"{MINILM} takes text: input must be a string or a non-empty list of strings "
                              "(token arrays are another tokenizer's ids)", "input")
    if len(texts) > MAX_INPUTS:
        raise invalid_request(f"input has {len(texts)} texts; at most {MAX_INPUTS} per request", "input")
    if any(not t for t in texts):
        raise invalid_request("input must not contain empty strings", "input")
    if req.dimensions is not None and req.dimensions != MINILM_DIMENSIONS:
        raise invalid_request(f"{MINILM} embeddings have {MINILM_DIMENSIONS} dimensions and cannot be shortened; "
                              "leave dimensions out", "dimensions")
    vectors, counts = await compressor.embed_texts(texts)  # type: ignore[arg-type]
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    used = sum(counts)
    return {"object": "list", "data": data, "model": MINILM, "usage": {"prompt_tokens": used, "total_tokens": used}}


def _encoded(vector: Any, encoding: str) -> Any:
    if encoding == "base64":  # little-endian float32, as api.openai.com sends it (and the SDK decodes it)
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()

