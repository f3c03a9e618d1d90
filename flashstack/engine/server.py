"""OpenAI-compatible engine server (like `vllm serve`): models, completions, chat completions."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from flashstack.engine.llm import AsyncLLM
from flashstack.engine.outputs import StreamDelta
from flashstack.engine.sampling import SamplingParams


class APIError(Exception):
    """An error returned to the client as OpenAI's `{"error": {...}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )


class StreamOptions(BaseModel):
    """`stream_options` as the OpenAI API defines it."""

    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields, accepted in the body (the SDK's `extra_body`).
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: bool = True

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams for this request."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_Sampling):
    """POST /v1/completions body."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    """One chat message; content may be a string or a list of text parts."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    """POST /v1/chat/completions body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None


def _error_body(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}},
        status_code=status,
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _finish(reason: str | None) -> str | None:
    # "abort" only happens when the client is gone; OpenAI has no such value.
    return "stop" if reason == "abort" else reason


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _message_text(m: ChatMessage) -> dict[str, Any]:
    content = m.content
    if isinstance(content, list):
        kinds = {p.get("type") for p in content}
        if kinds - {"text"}:
            raise APIError(
                400,
                f"only text content parts are supported, got {sorted(kinds - {'text'})}",
                param="messages",
            )
        content = "".join(p.get("text", "") for p in content)
    return {**m.model_dump(exclude_none=True), "content": content or ""}


class _Handler:
    """Request handling shared by both endpoints; routes stay thin."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def check_model(self, name: str) -> None:
        """404 for a model this server does not serve."""
        if name not in (self.model_name, self.engine.engine.config.model):
            raise APIError(
                404,
                f"model {name!r} is not served here; use {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def token_str(self, token_id: int) -> str:
        """Text of one token, for logprobs."""
        tok = self.engine.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok else str(token_id)

    async def run(
        self, prompt: str | list[int], params: SamplingParams
    ) -> tuple[str, list[StreamDelta]]:
        """Run to completion; the concatenated text and every delta."""
        deltas = [d async for d in self.stream(prompt, params)]
        return "".join(d.text for d in deltas), deltas

    async def stream(
        self, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[StreamDelta]:
        """Engine deltas with engine validation errors turned into 400s."""
        try:
            gen = self.engine.stream(prompt, params)
            first = await gen.__anext__()
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from exc
        yield first
        async for d in gen:
            yield d

    def chat_logprobs(self, deltas: list[StreamDelta], top: int) -> dict[str, Any] | None:
        """OpenAI chat `logprobs.content` for the deltas' tokens."""
        content = []
        for d in deltas:
            for tid, lp in zip(d.token_ids, d.logprobs or []):
                tops = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
                content.append(
                    {
                        "token": self.token_str(tid),
                        "logprob": lp[tid],
                        "bytes": None,
                        "top_logprobs": [
                            {"token": self.token_str(t), "logprob": v, "bytes": None}
                            for t, v in tops
                        ],
                    }
                )
        return {"content": content}

    def completion_logprobs(self, deltas: list[StreamDelta], top: int) -> dict[str, Any]:
        """Legacy completions `logprobs` object."""
        tokens, token_lps, top_lps = [], [], []
        for d in deltas:
            for tid, lp in zip(d.token_ids, d.logprobs or []):
                tokens.append(self.token_str(tid))
                token_lps.append(lp[tid])
                tops = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
                top_lps.append({self.token_str(t): v for t, v in tops})
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": top_lps,
            "text_offset": offsets,
        }


def _chat_prompt(h: _Handler, req: ChatRequest) -> list[int]:
    tok = h.engine.tokenizer
    if tok is None:
        raise APIError(
            400,
            "this model has no tokenizer, so chat is unavailable; use /v1/completions "
            "with token ids",
        )
    try:
        return tok.encode_chat([_message_text(m) for m in req.messages], tools=req.tools)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    except Exception as exc:  # jinja errors from the model's own template (raise_exception)
        raise APIError(400, f"chat template failed: {exc}", param="messages") from exc


async def _chat(h: _Handler, req: ChatRequest) -> Any:
    h.check_model(req.model)
    if req.n != 1:
        raise APIError(400, "n > 1 is not supported", param="n")
    top = req.top_logprobs or 0
    params = req.sampling_params(
        req.max_completion_tokens or req.max_tokens, top if req.logprobs else None
    )
    prompt = _chat_prompt(h, req)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "created": created, "model": h.model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _stream_response(
            _chat_chunks(h, prompt, params, base, include_usage, top, req.logprobs)
        )
    text, deltas = await h.run(prompt, params)
    last = deltas[-1]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": _finish(last.finish_reason),
        "logprobs": h.chat_logprobs(deltas, top) if req.logprobs else None,
    }
    return {
        **base,
        "object": "chat.completion",
        "choices": [choice],
        "usage": _usage(last.prompt_tokens, last.completion_tokens),
    }


async def _chat_chunks(
    h: _Handler,
    prompt: list[int],
    params: SamplingParams,
    base: dict[str, Any],
    include_usage: bool,
    top: int,
    logprobs: bool,
) -> AsyncIterator[str]:
    chunk = {**base, "object": "chat.completion.chunk"}
    gen = h.stream(prompt, params)
    first = await gen.__anext__()  # raises APIError before any byte is sent
    yield _sse(
        {
            **chunk,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None,
                    "logprobs": None,
                }
            ],
        }
    )
    last = first

    async def all_deltas() -> AsyncIterator[StreamDelta]:
        yield first
        async for d in gen:
            yield d

    async for d in all_deltas():
        last = d
        if d.text or d.finished or (logprobs and d.token_ids):
            yield _sse(
                {
                    **chunk,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": d.text} if d.text else {},
                            "finish_reason": _finish(d.finish_reason),
                            "logprobs": h.chat_logprobs([d], top) if logprobs else None,
                        }
                    ],
                }
            )
    if include_usage:
        yield _sse(
            {**chunk, "choices": [], "usage": _usage(last.prompt_tokens, last.completion_tokens)}
        )
    yield "data: [DONE]\n\n"


def _completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [p]  # type: ignore[list-item]
    if not p:
        raise APIError(400, "prompt is empty", param="prompt")
    return list(p)  # type: ignore[arg-type]


async def _completions(h: _Handler, req: CompletionRequest) -> Any:
    h.check_model(req.model)
    if req.n != 1:
        raise APIError(400, "n > 1 is not supported", param="n")
    prompts = _completion_prompts(req)
    params = req.sampling_params(req.max_tokens, req.logprobs)
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": h.model_name}
    if req.stream:
        if len(prompts) != 1:
            raise APIError(400, "streaming supports one prompt per request", param="prompt")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _stream_response(
            _completion_chunks(h, prompts[0], params, base, include_usage, req)
        )
    results = await asyncio.gather(*(h.run(p, params) for p in prompts))
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, ((text, deltas), p) in enumerate(zip(results, prompts)):
        last = deltas[-1]
        prompt_tokens += last.prompt_tokens
        completion_tokens += last.completion_tokens
        echo = (p if isinstance(p, str) else h.engine.tokenizer.decode(p)) if req.echo else ""
        choices.append(
            {
                "index": i,
                "text": echo + text,
                "finish_reason": _finish(last.finish_reason),
                "logprobs": h.completion_logprobs(deltas, req.logprobs)
                if req.logprobs is not None
                else None,
            }
        )
    return {
        **base,
        "object": "text_completion",
        "choices": choices,
        "usage": _usage(prompt_tokens, completion_tokens),
    }


async def _completion_chunks(
    h: _Handler,
    prompt: str | list[int],
    params: SamplingParams,
    base: dict[str, Any],
    include_usage: bool,
    req: CompletionRequest,
) -> AsyncIterator[str]:
    chunk = {**base, "object": "text_completion"}
    last: StreamDelta | None = None
    async for d in h.stream(prompt, params):
        last = d
        if d.text or d.finished:
            yield _sse(
                {
                    **chunk,
                    "choices": [
                        {
                            "index": 0,
                            "text": d.text,
                            "finish_reason": _finish(d.finish_reason),
                            "logprobs": h.completion_logprobs([d], req.logprobs)
                            if req.logprobs is not None
                            else None,
                        }
                    ],
                }
            )
    if include_usage and last is not None:
        yield _sse(
            {**chunk, "choices": [], "usage": _usage(last.prompt_tokens, last.completion_tokens)}
        )
    yield "data: [DONE]\n\n"


async def _stream_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    # Pull the first chunk now so request errors become a 4xx response instead of a broken stream.
    first = await chunks.__anext__()

    async def body() -> AsyncIterator[str]:
        yield first
        async for c in chunks:
            yield c

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def build_app(engine: AsyncLLM, model_name: str | None = None) -> FastAPI:
    """An OpenAI-compatible app over `engine`, serving it as `model_name` (default: dir name)."""
    app = FastAPI(title="flashstack engine")
    h = _Handler(engine, model_name or engine.model_name)
    app.state.handler = h

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_body(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        loc = ".".join(str(x) for x in errors[0]["loc"][1:]) if errors else None
        msg = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:])}: {e['msg']}" for e in errors[:5])
        return _error_body(400, msg or "invalid request", param=loc or None)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": h.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "flashstack",
                    "max_model_len": engine.engine.config.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        return await _completions(h, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest) -> Any:
        return await _chat(h, req)

    return app


def serve(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    **engine_kwargs: Any,
) -> None:
    """Load the model and serve it until interrupted (`flashstack engine serve --model PATH`)."""
    import uvicorn

    engine = AsyncLLM(model_path, **engine_kwargs)
    uvicorn.run(build_app(engine, model_name), host=host, port=port, log_level="info")
