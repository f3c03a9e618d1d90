"""Anthropic's Messages API (Claude), streamed and parsed event by event."""

from __future__ import annotations

from collections.abc import AsyncIterator

from flashstack.config import ModelConfig
from flashstack.gateway.core import ChatRequest, ChatResponse, Event
from flashstack.gateway.providers.base import Health, probe_health
from flashstack.gateway.providers.http import event_json, make_client, open_stream, post_json, sse_events
from flashstack.gateway.translate import anthropic as t

API_VERSION = "2023-06-01"


class AnthropicProvider:
    """Messages API over one pooled client."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.name = f"anthropic:{cfg.model}"
        headers = {"anthropic-version": API_VERSION}
        if cfg.api_key:
            headers["x-api-key"] = cfg.api_key
        self.client = make_client(cfg, headers)

    def _body(self, request: ChatRequest, stream: bool) -> dict:
        body = t.request_json(request, self.cfg.model, self.cfg.max_output_tokens)
        body.pop("stream", None)
        if stream:
            body["stream"] = True
        return body

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        decoder = t.EventDecoder()
        body = self._body(request, stream=True)
        async with open_stream(self.client, self.name, "/v1/messages", body, t.upstream_error) as resp:
            async for name, data in sse_events(resp, self.name):
                for ev in decoder.feed(name, event_json(data, self.name, "an event")):
                    yield ev

    async def complete(self, request: ChatRequest) -> ChatResponse:
        body = self._body(request, stream=False)
        return t.response_from_json(await post_json(self.client, self.name, "/v1/messages", body, t.upstream_error))

    async def list_models(self) -> list[str]:
        resp = await self.client.http.get("/v1/models", timeout=2.0)
        resp.raise_for_status()
        return [m["id"] for m in resp.json().get("data", [])]

    async def health(self) -> Health:
        return await probe_health(self.list_models)

    async def aclose(self) -> None:
        await self.client.aclose()
