"""Any OpenAI-compatible server: vLLM, llama.cpp, LM Studio, OpenAI itself, our engine."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from flashstack.config import ModelConfig
from flashstack.gateway.core import ChatRequest, ChatResponse, ErrorKind, Event, GatewayError
from flashstack.gateway.providers.base import Health, probe_health
from flashstack.gateway.providers.http import (
    event_json,
    make_client,
    open_stream,
    post_json,
    sse_events,
    transport_error,
)
from flashstack.gateway.translate import openai as t


class OpenAICompatProvider:
    """Chat completions over one pooled client; streams parsed chunk by chunk."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.name = f"openai:{cfg.api_base}/{cfg.model}"
        headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.client = make_client(cfg, headers)

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        body = t.request_json(request, self.cfg.model)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        decoder = t.ChunkDecoder()
        done = False
        async with open_stream(self.client, self.name, "/chat/completions", body, t.upstream_error) as resp:
            async for _, data in sse_events(resp, self.name):
                if data.strip() == b"[DONE]":
                    done = True
                    break
                for ev in decoder.feed(event_json(data, self.name, "a chunk")):
                    yield ev
        if not done and decoder.finish_reason is None:  # closed mid-answer: never pass it off as complete
            raise GatewayError(ErrorKind.UPSTREAM, f"{self.name} ended the stream early (no finish_reason, no [DONE])")
        for ev in decoder.finish():
            yield ev

    async def complete(self, request: ChatRequest) -> ChatResponse:
        body = t.request_json(request, self.cfg.model)
        body["stream"] = False
        body.pop("stream_options", None)
        return t.response_from_json(await post_json(self.client, self.name, "/chat/completions", body, t.upstream_error))

    async def list_models(self) -> list[str]:
        try:
            resp = await self.client.http.get("/models", timeout=2.0)
            resp.raise_for_status()
            return [m["id"] for m in resp.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise transport_error(self.name, e if isinstance(e, httpx.HTTPError) else httpx.HTTPError(str(e))) from e

    async def health(self) -> Health:
        return await probe_health(self.list_models)

    async def aclose(self) -> None:
        await self.client.aclose()
