"""Any OpenAI-compatible server: vLLM, llama.cpp, LM Studio, OpenAI itself, our engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from flashstack.gateway.config import ModelConfig, UpstreamLimits
from flashstack.gateway.core import (
    ChatRequest,
    ChatResponse,
    ErrorKind,
    Event,
    Exchange,
    Finish,
    GatewayError,
)
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
from flashstack.gateway.providers.usage import AnswerText, counted_finish, counted_response
from flashstack.gateway.redact import Redactor
from flashstack.gateway.translate import openai as t
from flashstack.gateway.translate import responses_upstream as rt
from flashstack.gateway.translate.fields import headers_for
from flashstack.gateway.translate.raw import tap_for


class OpenAICompatProvider:
    """Chat completions over one pooled client; streams parsed chunk by chunk."""

    def __init__(
        self, cfg: ModelConfig, limits: UpstreamLimits | None = None, redact: Redactor | None = None
    ) -> None:
        self.cfg = cfg
        self.upstream = Upstream.of(cfg, limits, redact)
        # the deployment id: errors never name the upstream's address
        self.name = self.upstream.name
        headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.client = make_client(cfg, headers, self.upstream)

    def _passes_responses(self, request: ChatRequest) -> bool:
        return request.wire == rt.WIRE and self.cfg.responses_api

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        if self._passes_responses(request):
            async for ev in self._responses_stream(request):
                yield ev
            return
        body = t.request_json(request, self.cfg.model)
        body["stream"] = True
        # for accounting
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        decoder = t.ChunkDecoder(tap_for(request.wire, t.WIRE), request.exchange.dropped)
        done = chosen = reported = False
        answer = AnswerText()  # counted if no chunk carries usage (llama.cpp's server sends none)
        up = self.upstream
        headers = headers_for(request, t.WIRE)
        async with open_stream(
            self.client, "/chat/completions", body, t.upstream_error, headers, request.exchange
        ) as resp:
            async for _, data in sse_events(resp, up):
                if data.strip() == b"[DONE]":
                    done = True
                    break
                chunk = event_json(data, up, "a chunk")
                chosen = chosen or bool(chunk.get("choices"))
                reported = reported or bool(chunk.get("usage"))
                for ev in up.decode(decoder.feed, chunk, what="a chunk"):
                    answer.feed(ev)
                    yield ev
        # closed mid-answer: never pass it off as complete
        if not done and decoder.finish_reason is None:
            raise GatewayError(
                ErrorKind.UPSTREAM,
                f"upstream {up.name} ended the stream early (no finish_reason, no [DONE])",
            )
        if not chosen:  # chunks without choices, then [DONE]: not an empty answer, no answer at all
            raise up.shape_error("a stream", "no chunk had choices")
        for ev in decoder.finish():
            if isinstance(ev, Finish) and not reported:
                ev = await counted_finish(ev, self.cfg, request, answer)
            yield ev

    async def complete(self, request: ChatRequest) -> ChatResponse:
        if self._passes_responses(request):
            reply = await post_json(
                self.client,
                "/responses",
                rt.request_json(request, self.cfg.model, False),
                t.upstream_error,
                headers_for(request, t.WIRE),
                request.exchange,
            )
            return self.upstream.translate(rt.response_from_json, reply, "a response")
        body = t.request_json(request, self.cfg.model)
        if request.wire != t.WIRE:  # an OpenAI client's body keeps its own stream fields, as sent
            body["stream"] = False
            body.pop("stream_options", None)
        reply = shape.openai_completion(
            await post_json(
                self.client,
                "/chat/completions",
                body,
                t.upstream_error,
                headers_for(request, t.WIRE),
                request.exchange,
            ),
            self.upstream,
        )
        keep = request.wire == t.WIRE  # the client gets the upstream's body whole
        resp = self.upstream.translate(
            lambda b: t.response_from_json(b, keep, request.exchange.dropped),
            reply,
            "a chat completion",
        )
        if not reply.get("usage"):  # counted, as a stream without usage is (a proxy may strip it)
            resp = await counted_response(resp, self.cfg, request)
        return resp

    async def _responses_stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        """A Responses client's request to an upstream that serves the Responses API:
        whole, both ways."""
        decoder, up, finished = rt.EventDecoder(), self.upstream, False
        async with open_stream(
            self.client,
            "/responses",
            rt.request_json(request, self.cfg.model, True),
            t.upstream_error,
            headers_for(request, t.WIRE),
            request.exchange,
        ) as resp:
            async for name, data in sse_events(resp, up):
                for ev in up.decode(
                    decoder.feed, name, event_json(data, up, "an event"), what="an event"
                ):
                    finished = finished or isinstance(ev, Finish)
                    yield ev
        if not finished:
            raise GatewayError(
                ErrorKind.UPSTREAM,
                f"upstream {up.name} ended the stream early (no response.completed)",
            )

    async def forward(
        self, path: str, body: dict[str, Any], exchange: Exchange | None = None
    ) -> Any:
        """POST an OpenAI-wire body as sent (embeddings, legacy completions); the
        upstream's JSON reply."""
        return await post_json(self.client, path, body, t.upstream_error, None, exchange)

    async def forward_stream(
        self, path: str, body: dict[str, Any], exchange: Exchange | None = None
    ) -> AsyncIterator[bytes]:
        """The same, streamed: the upstream's SSE events as they came (data lines;
        [DONE] included)."""
        async with open_stream(self.client, path, body, t.upstream_error, None, exchange) as resp:
            async for _, data in sse_events(resp, self.upstream):
                yield b"data: " + data + b"\n\n"

    async def list_models(self) -> list[str]:
        return shape.model_ids(await self.client.get_json("/models"), self.upstream, "data", "id")

    async def health(self) -> Health:
        return await probe_health(self.list_models)

    async def aclose(self) -> None:
        await self.client.aclose()
