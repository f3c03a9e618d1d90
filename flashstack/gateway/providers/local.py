"""The in-process engine as a provider: no HTTP hop between the gateway and the model."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from flashstack.gateway import telemetry
from flashstack.gateway.config import ModelConfig
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
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
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
        self._grammars: Any = None  # flashstack.engine.guided.GrammarCompiler, made on first use

    async def engine(self) -> Any:
        """The engine, loading it once (off the event loop) on first call."""
        if self._engine is None:
            async with self._loading:
                if self._engine is None:
                    from flashstack.engine import AsyncLLM

                    options = {"enable_prefix_caching": True, **self.cfg.engine.engine_kwargs()}
                    self._engine = await asyncio.to_thread(AsyncLLM, self.cfg.model, **options)
        return self._engine

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        engine = await self.engine()
        plan = _tool_plan(engine, request)
        guide = await self._guide(engine, _guide_spec(request, plan))
        async for ev in self._generate(
            engine, _prompt_ids(engine, request, plan), request, plan, guide
        ):
            yield ev

    async def _guide(self, engine: Any, spec: Any) -> Any:
        """The request's compiled grammar (off the event loop); a 400 naming what cannot compile."""
        if spec is None:
            return None
        from flashstack.engine.guided import GrammarCompiler, GrammarError

        if self._grammars is None:
            vocab = engine.engine.model.args.vocab_size
            self._grammars = await asyncio.to_thread(GrammarCompiler, engine.tokenizer, vocab)
        try:
            return await asyncio.to_thread(self._grammars.compile, spec)
        except GrammarError as e:
            raise invalid_request(str(e), "response_format") from None

    async def stream_prompt(
        self, prompt: str | list[int], request: ChatRequest
    ) -> AsyncIterator[Event]:
        """A raw prompt (text or token ids), no chat template: legacy `/v1/completions`; `request`
        carries the sampling fields."""
        engine = await self.engine()
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise invalid_request(
                    f"local model {request.model!r} has no tokenizer; send the prompt as token ids"
                )
            prompt = engine.tokenizer.encode(prompt)
        async for ev in self._generate(engine, prompt, request):
            yield ev

    async def _generate(
        self,
        engine: Any,
        prompt: list[int],
        request: ChatRequest,
        plan: Any = None,
        guide: Any = None,
    ) -> AsyncIterator[Event]:
        params = _sampling_params(request, self.cfg)
        params.guide = guide
        rid = "msg_" + uuid.uuid4().hex[:24]
        started = False
        blocks = _Blocks(plan.stream() if plan is not None else None)
        # now: a stream ends after the router stopped sending
        traced = telemetry.EngineTrace.current()
        try:
            async for delta in engine.stream(prompt, params, request_id=rid):
                if not started:
                    started = True
                    yield Start(rid, self.cfg.name, Usage(input_tokens=delta.prompt_tokens))
                for ev in blocks.feed(delta.text, delta.finished):
                    yield ev
                if delta.finished:
                    # before the attempt's span ends
                    if traced is not None and delta.times is not None:
                        traced.stages(
                            delta.times,
                            delta.prompt_tokens,
                            delta.num_cached_tokens,
                            delta.completion_tokens,
                        )
                    yield from_finish(delta, blocks.called)
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
        # a GGUF file is a whole model, else a HF directory
        is_gguf = path.suffix.lower() == ".gguf"
        ok = path.is_file() if is_gguf else (path / "config.json").is_file()
        return Health(
            ok, 0.0 if ok else None, "" if ok else f"no model at {self.cfg.model}", time.time()
        )

    async def aclose(self) -> None:
        if self._engine is not None:
            await self._engine.close()


class _Blocks:
    """Engine text → canonical content blocks: text, and tool calls as the engine's tool call
    parsers find them (each call its own block, its arguments streamed as they come)."""

    def __init__(self, tools: Any) -> None:
        self.tools, self.called = tools, False
        self.open: int | None = None  # the block being written
        self.next, self._call_blocks = 0, {}

    def _switch(self, key: Any) -> list[Event]:
        events: list[Event] = []
        if self.open is not None:
            events.append(BlockStop(self.open))
        self.open, self.next = self.next, self.next + 1
        if key is not None:
            self._call_blocks[key] = self.open
        return events

    def feed(self, text: str, final: bool) -> list[Event]:
        events: list[Event] = []
        delta = self.tools.feed(text, final) if self.tools is not None else {"content": text}
        if delta.get("content"):
            if self.open is None or self.open in self._call_blocks.values():
                events += self._switch(None)
            events.append(TextDelta(self.open, delta["content"]))
        for piece in delta.get("tool_calls", []):
            self.called = True
            if piece.get("id"):
                events += self._switch(piece["index"])
                events.append(ToolCallStart(self.open, piece["id"], piece["function"]["name"]))
            if piece["function"].get("arguments"):
                events.append(
                    ToolArgsDelta(self._call_blocks[piece["index"]], piece["function"]["arguments"])
                )
        if final:
            events.append(BlockStop(self.open if self.open is not None else 0))
        return events


def from_finish(delta: Any, called: bool) -> Finish:
    """The Finish event of the engine's last delta; a stop after tool calls is TOOL_USE."""
    finish = _finish(delta)
    if called and finish.stop_reason is StopReason.END_TURN:
        finish.stop_reason = StopReason.TOOL_USE
    return finish


def _finish(delta: Any) -> Finish:
    usage = Usage(delta.prompt_tokens, delta.completion_tokens)
    if delta.finish_reason == "length":
        return Finish(StopReason.MAX_TOKENS, usage)
    if delta.finish_reason == "abort":
        raise GatewayError(ErrorKind.UPSTREAM, "the local engine aborted the request")
    if isinstance(delta.stop_reason, str):
        return Finish(StopReason.STOP_SEQUENCE, usage, delta.stop_reason)
    return Finish(StopReason.END_TURN, usage)


def openai_tools(request: ChatRequest) -> list[dict[str, Any]]:
    """The request's tools as a chat template takes them (OpenAI's function shape)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description or "",
                "parameters": t.parameters or {"type": "object"},
            },
        }
        for t in request.tools
    ]


def _openai_tool_choice(request: ChatRequest) -> Any:
    tc = request.tool_choice
    if tc is None:
        return None
    if tc.mode == "tool":
        return {"type": "function", "function": {"name": tc.name}}
    return {"any": "required"}.get(tc.mode, tc.mode)


def _tool_plan(engine: Any, request: ChatRequest) -> Any:
    """How the engine's tool call parsers handle this request (flashstack.engine.server_tools)."""
    from flashstack.engine.server_tools import RequestError, plan_tools

    template = engine.tokenizer.chat_template if engine.tokenizer is not None else None
    try:
        return plan_tools(openai_tools(request), _openai_tool_choice(request), template)
    except RequestError as e:
        raise invalid_request(str(e), e.param) from None


def _guide_spec(request: ChatRequest, plan: Any) -> Any:
    """The grammar a forced tool call or the response_format asks for."""
    from flashstack.engine.server_tools import RequestError, guide_spec

    forced = plan.guide()
    rf = request.response_format
    if rf is None or rf.type == "text":
        return forced
    if forced is not None:
        raise invalid_request(
            f"tool_choice {request.tool_choice.mode!r} already constrains the output; "
            "drop response_format",
            "response_format",
        )
    wire = {"type": rf.type, "json_schema": {"name": rf.name, "schema": rf.schema}}
    try:
        return guide_spec(wire)
    except RequestError as e:
        raise invalid_request(str(e), e.param) from None


def _prompt_ids(engine: Any, request: ChatRequest, plan: Any = None) -> list[int]:
    """Render the request with the model's own chat template (tools as the plan shows them)."""
    if engine.tokenizer is None:
        raise invalid_request(
            f"local model {request.model!r} has no tokenizer; it cannot take chat requests"
        )
    messages = chat_messages(request)
    tools = None
    if plan is not None:
        messages, tools = plan.prompt(messages, engine.tokenizer.chat_template)
    return engine.tokenizer.encode_chat(messages, tools=tools)


def chat_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """The request as a chat template's messages (tool calls and results in OpenAI's shape); a
    400 for what a local model cannot take."""
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": request.system_text()})
    for m in request.messages:
        for p in m.parts:
            if isinstance(p, Image):
                raise invalid_request(
                    f"local model {request.model!r} does not accept images", "messages"
                )
            if isinstance(p, Opaque):
                raise invalid_request(
                    f"local model {request.model!r} cannot read content of type {p.type!r}; "
                    "remove it or choose a model served over the API it came from",
                    "messages",
                )
        text = "".join(p.text for p in m.parts if isinstance(p, Text))
        calls = [p for p in m.parts if isinstance(p, ToolCall)]
        results = [p for p in m.parts if isinstance(p, ToolResult)]
        if text or not results:
            message: dict[str, Any] = {"role": m.role, "content": text}
            if calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in calls
                ]
            messages.append(message)
        for r in results:  # each result its own `tool` message, as OpenAI sends them
            content = "".join(t.text for t in r.content if isinstance(t, Text))
            messages.append({"role": "tool", "tool_call_id": r.tool_call_id, "content": content})
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
