"""The in-process engine as a provider: no HTTP hop between the gateway and the model."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from flashstack.config import ModelConfig
from flashstack.gateway.core import (
    BlockStop,
    ChatRequest,
    ChatResponse,
    ErrorKind,
    Event,
    Finish,
    GatewayError,
    Image,
    Opaque,
    Start,
    StopReason,
    Text,
    TextDelta,
    ToolCall,
    ToolResult,
    Usage,
    invalid_request,
)
from flashstack.gateway.providers.base import Health, collect

DEFAULT_MAX_TOKENS = 512


class LocalProvider:
    """flashstack.engine's AsyncLLM, loaded on first use in a worker thread."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.name = f"local:{cfg.model}"
        self._engine: Any = None
        self._loading = asyncio.Lock()

    async def engine(self) -> Any:
        """The engine, loading it once (off the event loop) on first call."""
        if self._engine is None:
            async with self._loading:
                if self._engine is None:
                    from flashstack.engine import AsyncLLM

                    options = {"enable_prefix_caching": True, **self.cfg.engine}
                    self._engine = await asyncio.to_thread(AsyncLLM, self.cfg.model, **options)
        return self._engine

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        engine = await self.engine()
        async for ev in self._generate(engine, _prompt_ids(engine, request), request):
            yield ev

    async def stream_prompt(self, prompt: str | list[int], request: ChatRequest) -> AsyncIterator[Event]:
        """A raw prompt (text or token ids), no chat template: legacy `/v1/completions`; `request`
        carries the sampling fields."""
        engine = await self.engine()
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise invalid_request(f"local model {request.model!r} has no tokenizer; send the prompt as token ids")
            prompt = engine.tokenizer.encode(prompt)
        async for ev in self._generate(engine, prompt, request):
            yield ev

    async def _generate(self, engine: Any, prompt: list[int], request: ChatRequest) -> AsyncIterator[Event]:
        params = _sampling_params(request, self.cfg)
        rid = "msg_" + uuid.uuid4().hex[:24]
        started = False
        try:
            async for delta in engine.stream(prompt, params, request_id=rid):
                if not started:
                    started = True
                    yield Start(rid, self.cfg.name, Usage(input_tokens=delta.prompt_tokens))
                if delta.text:
                    yield TextDelta(0, delta.text)
                if delta.finished:
                    yield BlockStop(0)
                    yield _finish(delta)
        except ValueError as e:  # the engine refuses a request it cannot run (too long, ...)
            code = "context_length_exceeded" if "tokens" in str(e) else None
            raise GatewayError(ErrorKind.INVALID_REQUEST, str(e), code=code) from None

    async def complete(self, request: ChatRequest) -> ChatResponse:
        return await collect(self.stream(request))

    async def list_models(self) -> list[str]:
        return [self.cfg.name]

    async def health(self) -> Health:
        from pathlib import Path

        path = Path(self.cfg.model)
        is_gguf = path.suffix.lower() == ".gguf"  # a GGUF file is a whole model, else a HF directory
        ok = path.is_file() if is_gguf else (path / "config.json").is_file()
        return Health(ok, 0.0 if ok else None, "" if ok else f"no model at {self.cfg.model}", time.time())

    async def aclose(self) -> None:
        if self._engine is not None:
            await self._engine.close()


def _finish(delta: Any) -> Finish:
    usage = Usage(delta.prompt_tokens, delta.completion_tokens)
    if delta.finish_reason == "length":
        return Finish(StopReason.MAX_TOKENS, usage)
    if delta.finish_reason == "abort":
        raise GatewayError(ErrorKind.UPSTREAM, "the local engine aborted the request")
    if isinstance(delta.stop_reason, str):
        return Finish(StopReason.STOP_SEQUENCE, usage, delta.stop_reason)
    return Finish(StopReason.END_TURN, usage)


def _prompt_ids(engine: Any, request: ChatRequest) -> list[int]:
    """Render the request with the model's own chat template."""
    if engine.tokenizer is None:
        raise invalid_request(f"local model {request.model!r} has no tokenizer; it cannot take chat requests")
    return engine.tokenizer.encode_chat(chat_messages(request))


def chat_messages(request: ChatRequest) -> list[dict[str, str]]:
    """The request as a chat template's messages; a 400 for what a local model cannot take."""
    messages: list[dict[str, str]] = []
    if request.system:
        messages.append({"role": "system", "content": request.system_text()})
    for m in request.messages:
        for p in m.parts:
            if isinstance(p, Image):
                raise invalid_request(f"local model {request.model!r} does not accept images", "messages")
            if isinstance(p, (ToolCall, ToolResult)):
                raise invalid_request(f"local model {request.model!r} does not support tool calls", "messages")
            if isinstance(p, Opaque):
                raise invalid_request(f"local model {request.model!r} cannot read content of type {p.type!r}; "
                                      "remove it or choose a model served over the API it came from", "messages")
        text = "".join(p.text for p in m.parts if isinstance(p, Text))
        messages.append({"role": m.role, "content": text})
    if request.tools and (request.tool_choice is None or request.tool_choice.mode != "none"):
        raise invalid_request(f"local model {request.model!r} does not support tools", "tools")
    return messages


def _default(value: float | None, configured: float | None, fallback: float) -> float:
    """The request's value, else the deployment's default, else the wire protocols' own."""
    return value if value is not None else configured if configured is not None else fallback


def _sampling_params(request: ChatRequest, cfg: ModelConfig) -> Any:
    from flashstack.engine import SamplingParams

    try:
        return SamplingParams(
            temperature=_default(request.temperature, cfg.default_temperature, 1.0),
            top_p=_default(request.top_p, cfg.default_top_p, 1.0),
            top_k=request.top_k or 0,
            max_tokens=request.max_tokens or cfg.max_output_tokens or DEFAULT_MAX_TOKENS,
            stop=list(request.stop),
            seed=request.seed,
        )
    except ValueError as e:
        raise invalid_request(str(e)) from None
