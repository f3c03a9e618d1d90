"""Anthropic's Messages API (Claude), streamed and parsed event by event."""

from __future__ import annotations

from collections.abc import AsyncIterator

from flashstack.gateway.config import ModelConfig, UpstreamLimits
from flashstack.gateway.core import ChatRequest, ChatResponse, Event
from flashstack.gateway.providers import shape
from flashstack.gateway.providers.base import Health, probe_health
from flashstack.gateway.providers.http import (
    event_json,
    make_client,
    open_stream,
    post_json,
    sse_events,
)
from flashstack.gateway.providers.upstream import Upstream
from flashstack.gateway.redact import Redactor
from flashstack.gateway.translate import anthropic as t
from flashstack.gateway.translate.fields import headers_for
from flashstack.gateway.translate.raw import tap_for

API_VERSION = "2023-06-01"


class AnthropicProvider:
    """Messages API over one pooled client."""

    def __init__(
        self, cfg: ModelConfig, limits: UpstreamLimits | None = None, redact: Redactor | None = None
    ) -> None:
        self.cfg = cfg
        self.upstream = Upstream.of(cfg, limits, redact)
        # the deployment id: errors never name the upstream's address
        self.name = self.upstream.name
        headers = {"anthropic-version": API_VERSION}
        if cfg.api_key:
            headers["x-api-key"] = cfg.api_key
        self.client = make_client(cfg, headers, self.upstream)

    def _body(self, request: ChatRequest, stream: bool) -> dict:
        body = t.request_json(request, self.cfg.model, self.cfg.max_output_tokens)
        if stream:
            body["stream"] = True
        elif request.wire != t.WIRE:  # an Anthropic client's body keeps its own `stream`, as sent
            body.pop("stream", None)
        return body

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        decoder = t.EventDecoder(tap_for(request.wire, t.WIRE), request.exchange.dropped)
        body = self._body(request, stream=True)
        up = self.upstream
        headers = headers_for(request, t.WIRE)
        async with open_stream(
            self.client, "/v1/messages", body, t.upstream_error, headers, request.exchange
        ) as resp:
            async for name, data in sse_events(resp, up):
                for ev in up.decode(
                    decoder.feed, name, event_json(data, up, "an event"), what="an event"
                ):
                    yield ev

    async def complete(self, request: ChatRequest) -> ChatResponse:
        body = self._body(request, stream=False)
        reply = shape.anthropic_message(
            await post_json(
                self.client,
                "/v1/messages",
                body,
                t.upstream_error,
                headers_for(request, t.WIRE),
                request.exchange,
            ),
            self.upstream,
        )
        keep = request.wire == t.WIRE  # the client gets the upstream's body whole
        return self.upstream.translate(
            lambda b: t.response_from_json(b, keep, request.exchange.dropped), reply, "a message"
        )

    async def count_tokens(self, request: ChatRequest) -> dict:
        """The upstream's own count for an Anthropic client's count_tokens body (model renamed)."""
        body = t.request_json(request, self.cfg.model)
        # count_tokens takes none; request_json always sets one
        if "max_tokens" not in request.extra:
            body.pop("max_tokens", None)
        return await post_json(
            self.client,
            "/v1/messages/count_tokens",
            body,
            t.upstream_error,
            headers_for(request, t.WIRE),
            request.exchange,
        )

    async def list_models(self) -> list[str]:
        return shape.model_ids(
            await self.client.get_json("/v1/models"), self.upstream, "data", "id"
        )

    async def health(self) -> Health:
        return await probe_health(self.list_models)

    async def aclose(self) -> None:
        await self.client.aclose()
