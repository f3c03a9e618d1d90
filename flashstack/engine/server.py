"""OpenAI-compatible engine server (like `vllm serve`): models, completions, chat completions."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import ASGIApp

from flashstack.engine.core_process import EngineCoreClient
from flashstack.engine.gc_heap import freeze_startup_heap
from flashstack.engine.guided import GrammarCompiler, GrammarError, Guide, GuideSpec
from flashstack.engine.lifecycle import (
    Drain,
    DrainingServer,
    EdgeMiddleware,
    EngineApp,
    PostRoute,
    ServeOptions,
)
from flashstack.engine.llm import AsyncLLM
from flashstack.engine.metrics import ServerMetrics
from flashstack.engine.outputs import StreamDelta
from flashstack.engine.sampling import SamplingParams
from flashstack.engine.server_tools import RequestError, ToolPlan, guide_spec, plan_tools
from flashstack.engine.sse import EventStreamResponse

# One OpenAI front end: the gateway's wire types, error shape and SSE framing.
from flashstack.gateway.core import ErrorKind, GatewayError, invalid_request
from flashstack.gateway.wire import openai as wire
from flashstack.gateway.wire.openai import StreamOptions, error_json

log = logging.getLogger("flashstack.engine")


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
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
    # Structured output (flashstack.engine.server_tools): OpenAI's response_format, vLLM's guided_*.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

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
    best_of: int | None = Field(None, ge=1, le=128)


class ChatRequest(_Sampling):
    """POST /v1/chat/completions body."""

    messages: list[wire.Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with chat messages, rendered by the model's template (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[wire.Message] = Field(min_length=1)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def _error_response(err: GatewayError) -> JSONResponse:
    return JSONResponse(error_json(err), status_code=err.status)


def _finish(reason: str | None) -> str | None:
    # "abort" only happens when the client is gone; OpenAI has no such value.
    return "stop" if reason == "abort" else reason


class _TextEvents:
    """SSE events of a completion stream without logprobs, the fields that never change encoded
    once per stream: a token's event costs one small dump, not the whole chunk's."""

    def __init__(self, chunk: dict[str, Any]) -> None:
        head = orjson.dumps(chunk)[:-1]
        self.head = b"data: " + head + b',"choices":[{"index":'

    def event(self, index: int, text: str, finish: str | None) -> bytes:
        """The chunk `wire.sse_event` would write for this choice's delta, byte for byte."""
        reason = orjson.dumps(finish)
        return b'%s%d,"text":%s,"finish_reason":%s,"logprobs":null}]}\n\n' % (
            self.head,
            index,
            orjson.dumps(text),
            reason,
        )


def _message_text(m: BaseModel) -> dict[str, Any]:
    """A chat message as the model's template reads it: text parts joined into one string."""
    message = m.model_dump(exclude_none=True)
    content = message.get("content")
    if isinstance(content, list):
        kinds = {p.get("type") for p in content}
        if kinds - {"text"}:
            raise invalid_request(
                f"only text content parts are supported, got {sorted(kinds - {'text'})}",
                param="messages",
            )
        content = "".join(p.get("text", "") for p in content)
    return {**message, "content": content or ""}


class _Handler:
    """Request handling shared by both endpoints; routes stay thin."""

    def __init__(self, engine: AsyncLLM, model_names: list[str], metrics: ServerMetrics) -> None:
        self.engine, self.model_names, self.metrics = engine, model_names, metrics
        self.model_name = model_names[0]  # the name responses report, as vLLM does

    async def guide(self, spec: GuideSpec | None) -> Guide | None:
        """The compiled grammar of a request (off the event loop); 400 naming what failed."""
        if spec is None:
            return None
        tok = self.engine.tokenizer
        if tok is None:
            raise invalid_request(
                "structured output needs the model's tokenizer", param="response_format"
            )
        if self._grammars is None:
            await asyncio.to_thread(self.prepare_grammars)
        if self._grammars is None:
            raise invalid_request(self._grammars_error or "", param=spec.describe())
        try:
            return await asyncio.to_thread(self._grammars.compile, spec)
        except GrammarError as exc:
            raise invalid_request(str(exc), param=spec.describe()) from exc

    _grammars: GrammarCompiler | None = None
    _grammars_error: str | None = None

    def prepare_grammars(self) -> None:
        """Build the grammar compiler now (about 1 s of imports and vocabulary tables, holding the
        GIL for up to 0.4 s at a time: before serving, not inside the first guided request).

        A vocabulary xgrammar refuses leaves structured output unavailable: each guided request
        is then a 400 saying why, and the server serves everything else."""
        tok = self.engine.tokenizer
        if self._grammars is not None or self._grammars_error is not None or tok is None:
            return
        try:
            self._grammars = GrammarCompiler(tok, self.engine.info.vocab_size)
        except Exception as exc:  # the library's own checks of the vocabulary, whatever they raise
            self._grammars_error = f"structured output is unavailable for this model: {exc}"
            log.warning("%s", self._grammars_error)

    def check_model(self, name: str) -> None:
        """404 for a model this server does not serve."""
        if name not in (*self.model_names, self.engine.info.model):
            raise GatewayError(
                ErrorKind.NOT_FOUND,
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
            raise invalid_request(str(exc), param="prompt") from exc
        if first.finished:
            self.metrics.observe_finished(first)
        yield first
        async for d in gen:
            if d.finished:
                self.metrics.observe_finished(d)
            yield d

    async def run_choices(
        self, prompt: str | list[int], params: SamplingParams, n: int, best_of: int | None = None
    ) -> list[tuple[str, list[StreamDelta]]]:
        """`n` completions of one prompt (the best `n` of `best_of` by cumulative logprob).

        The first sequence runs alone until its first token: by then its prompt's full blocks
        are in the prefix cache, so the others attach to them instead of prefilling again.
        """
        total = max(n, best_of or n)
        if total == 1:
            return [await self.run(prompt, params)]
        if best_of is not None and params.logprobs is None:
            params = dataclasses.replace(params, logprobs=0)  # ranking needs each token's logprob
        each = [_choice_params(params, i) for i in range(total)]
        gen = self.stream(prompt, each[0])
        first = await gen.__anext__()
        tasks = [asyncio.ensure_future(_collect(first, gen))]
        tasks += [asyncio.ensure_future(self.run(prompt, p)) for p in each[1:]]
        try:
            results = list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # stops the rest when one failed or the client left
                t.cancel()
        if best_of is not None:
            results = sorted(results, key=lambda r: -_cumulative_logprob(r[1]))[:n]
        return results

    async def stream_choices(
        self, prompt: str | list[int], params: SamplingParams, n: int
    ) -> AsyncIterator[tuple[int, StreamDelta]]:
        """`n` choices' deltas as they come, each with its choice index; prompt blocks shared as in
        `run_choices`."""
        each = [_choice_params(params, i) for i in range(n)]
        gen = self.stream(prompt, each[0])
        first = await gen.__anext__()  # raises GatewayError before any byte is sent
        yield 0, first
        if n == 1:
            async for d in gen:
                yield 0, d
            return
        queue: asyncio.Queue[tuple[int, StreamDelta] | Exception] = asyncio.Queue()

        async def pump(i: int, deltas: AsyncIterator[StreamDelta]) -> None:
            try:
                async for d in deltas:
                    queue.put_nowait((i, d))
            except Exception as exc:  # handed to the reader, which raises it
                queue.put_nowait(exc)

        tasks = [asyncio.ensure_future(pump(0, gen))]
        tasks += [asyncio.ensure_future(pump(i, self.stream(prompt, each[i]))) for i in range(1, n)]
        try:
            done = int(first.finished)
            while done < n:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                done += int(item[1].finished)
                yield item
        finally:
            for t in tasks:  # the client left or one choice failed: abort the rest
                t.cancel()

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


def _choice_params(params: SamplingParams, i: int) -> SamplingParams:
    # A seeded request's choices must differ from each other yet repeat across calls.
    if params.seed is None or i == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + i)


async def _collect(
    first: StreamDelta, gen: AsyncIterator[StreamDelta]
) -> tuple[str, list[StreamDelta]]:
    deltas = [first, *[d async for d in gen]]
    return "".join(d.text for d in deltas), deltas


def _cumulative_logprob(deltas: list[StreamDelta]) -> float:
    return sum(lp[t] for d in deltas for t, lp in zip(d.token_ids, d.logprobs or []))


def _check_choices(n: int, best_of: int | None, stream: bool) -> None:
    if best_of is not None and best_of < n:
        raise invalid_request(f"best_of ({best_of}) must be >= n ({n})", param="best_of")
    if stream and best_of is not None and best_of != n:
        # As vLLM: the best choices are only known at the end, so there is nothing to stream.
        raise invalid_request("best_of cannot be streamed; drop stream or best_of", param="best_of")


def _structured(req: _Sampling, plan: ToolPlan | None = None) -> GuideSpec | None:
    """The request's grammar: a forced tool call's, or the response_format / guided_* one."""
    try:
        spec = guide_spec(req.response_format, req.guided_json, req.guided_regex, req.guided_choice)
    except (RequestError, ValueError) as exc:
        raise invalid_request(str(exc), param=getattr(exc, "param", "guided_json")) from exc
    forced = plan.guide() if plan is not None else None
    if forced is not None and spec is not None:
        raise invalid_request(
            f"tool_choice={plan.mode!r} already constrains the output; drop {spec.describe()}",
            param="tool_choice",
        )
    return forced or spec


def _tool_plan(h: _Handler, req: ChatRequest) -> ToolPlan:
    tok = h.engine.tokenizer
    try:
        return plan_tools(req.tools, req.tool_choice, tok.chat_template if tok else None)
    except RequestError as exc:
        raise invalid_request(str(exc), param=exc.param) from exc


def _chat_prompt(h: _Handler, req: ChatRequest, plan: ToolPlan) -> list[int]:
    tok = h.engine.tokenizer
    if tok is None:
        raise invalid_request(
            "this model has no tokenizer, so chat is unavailable; use /v1/completions "
            "with token ids",
        )
    try:
        messages, tools = plan.prompt([_message_text(m) for m in req.messages], tok.chat_template)
        return tok.encode_chat(messages, tools=tools)
    except ValueError as exc:
        raise invalid_request(str(exc), param="messages") from exc
    except Exception as exc:  # jinja errors from the model's own template (raise_exception)
        raise invalid_request(f"chat template failed: {exc}", param="messages") from exc


async def _chat(h: _Handler, req: ChatRequest) -> Any:
    h.check_model(req.model)
    _check_choices(req.n, None, req.stream)
    top = req.top_logprobs or 0
    params = req.sampling_params(
        req.max_completion_tokens or req.max_tokens, top if req.logprobs else None
    )
    plan = _tool_plan(h, req)
    prompt = _chat_prompt(h, req, plan)
    params.guide = await h.guide(_structured(req, plan))
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "created": created, "model": h.model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _stream_response(
            _chat_chunks(h, prompt, params, base, include_usage, top, req.logprobs, plan, req.n)
        )
    results = await h.run_choices(prompt, params, req.n)
    choices = []
    for i, (text, deltas) in enumerate(results):
        message, called = plan.message(text)
        choice = {
            "index": i,
            "message": message,
            "finish_reason": "tool_calls"
            if called and deltas[-1].finish_reason == "stop"
            else _finish(deltas[-1].finish_reason),
            "logprobs": h.chat_logprobs(deltas, top) if req.logprobs else None,
        }
        choices.append(choice)
    completion_tokens = sum(deltas[-1].completion_tokens for _, deltas in results)
    return {
        **base,
        "object": "chat.completion",
        "choices": choices,
        "usage": wire.usage_body(results[0][1][-1].prompt_tokens, completion_tokens),
    }


async def _chat_chunks(
    h: _Handler,
    prompt: list[int],
    params: SamplingParams,
    base: dict[str, Any],
    include_usage: bool,
    top: int,
    logprobs: bool,
    plan: ToolPlan | None = None,
    n: int = 1,
) -> AsyncIterator[bytes]:
    """Chat chunks of `n` choices, interleaved as they come, each with its index (as OpenAI)."""
    chunk = {**base, "object": "chat.completion.chunk"}
    tools = [plan.stream() if plan is not None else None for _ in range(n)]
    last: dict[int, StreamDelta] = {}

    def event(i: int, delta: dict[str, Any], finish: str | None, lps: Any = None) -> bytes:
        choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lps}
        return wire.sse_event({**chunk, "choices": [choice]})

    greeted: set[int] = set()
    async for i, d in h.stream_choices(prompt, params, n):  # raises GatewayError before any byte
        if i not in greeted:  # every choice opens with the assistant role
            greeted.add(i)
            yield event(i, {"role": "assistant", "content": ""}, None)
        last[i] = d
        parser = tools[i]
        delta = (
            parser.feed(d.text, d.finished) if parser else ({"content": d.text} if d.text else {})
        )
        finish = _finish(d.finish_reason)
        if parser and parser.called and finish == "stop":
            finish = "tool_calls"
        if delta or d.finished or (logprobs and d.token_ids):
            yield event(i, delta, finish, h.chat_logprobs([d], top) if logprobs else None)
    if include_usage and last:
        completion_tokens = sum(d.completion_tokens for d in last.values())
        usage = wire.usage_body(last[0].prompt_tokens, completion_tokens)
        yield wire.sse_event({**chunk, "choices": [], "usage": usage})
    yield wire.SSE_DONE


def _completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [p]  # type: ignore[list-item]
    if not p:
        raise invalid_request("prompt is empty", param="prompt")
    return list(p)  # type: ignore[arg-type]


async def _completions(h: _Handler, req: CompletionRequest) -> Any:
    h.check_model(req.model)
    _check_choices(req.n, req.best_of, req.stream)
    prompts = _completion_prompts(req)
    params = req.sampling_params(req.max_tokens, req.logprobs)
    params.guide = await h.guide(_structured(req))
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": h.model_name}
    if req.stream:
        if len(prompts) != 1:
            raise invalid_request("streaming supports one prompt per request", param="prompt")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _stream_response(
            _completion_chunks(h, prompts[0], params, base, include_usage, req)
        )
    per_prompt = await asyncio.gather(
        *(h.run_choices(p, params, req.n, req.best_of) for p in prompts)
    )
    choices, prompt_tokens, completion_tokens = [], 0, 0
    # vLLM's order: prompt by prompt, each prompt's n choices together.
    numbered = [(r, p) for rs, p in zip(per_prompt, prompts) for r in rs]
    for i, ((text, deltas), p) in enumerate(numbered):
        last = deltas[-1]
        if i % req.n == 0:  # a prompt's choices share it: count it once
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
        "usage": wire.usage_body(prompt_tokens, completion_tokens),
    }


async def _completion_chunks(
    h: _Handler,
    prompt: str | list[int],
    params: SamplingParams,
    base: dict[str, Any],
    include_usage: bool,
    req: CompletionRequest,
) -> AsyncIterator[bytes]:
    chunk = {**base, "object": "text_completion"}
    last: dict[int, StreamDelta] = {}
    plain = _TextEvents(chunk) if req.logprobs is None else None
    async for i, d in h.stream_choices(prompt, params, req.n):
        last[i] = d
        if plain is not None and (d.text or d.finished):
            yield plain.event(i, d.text, _finish(d.finish_reason))
        elif d.text or d.finished:
            yield wire.sse_event(
                {
                    **chunk,
                    "choices": [
                        {
                            "index": i,
                            "text": d.text,
                            "finish_reason": _finish(d.finish_reason),
                            "logprobs": h.completion_logprobs([d], req.logprobs),
                        }
                    ],
                }
            )
    if include_usage and last:
        completion_tokens = sum(d.completion_tokens for d in last.values())
        usage = wire.usage_body(last[0].prompt_tokens, completion_tokens)
        yield wire.sse_event({**chunk, "choices": [], "usage": usage})
    yield wire.SSE_DONE


async def _stream_response(chunks: AsyncGenerator[bytes, None]) -> EventStreamResponse:
    # Pull the first chunk now so request errors become a 4xx response instead of a broken stream.
    first = await chunks.__anext__()
    return EventStreamResponse(first, chunks)


def _tokenizer(h: _Handler, model: str | None):
    if model is not None:
        h.check_model(model)
    if h.engine.tokenizer is None:
        raise invalid_request("this model has no tokenizer; send and read token ids instead")
    return h.engine.tokenizer


def _tokenize(h: _Handler, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    tok = _tokenizer(h, req.model)
    if isinstance(req, TokenizeChatRequest):
        try:
            messages = [_message_text(m) for m in req.messages]
            ids = tok.encode_chat(
                messages, add_generation_prompt=req.add_generation_prompt, tools=req.tools
            )
        except GatewayError:
            raise
        except Exception as exc:  # the model's own template may raise (raise_exception)
            raise invalid_request(f"chat template failed: {exc}", param="messages") from exc
    else:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = None
    if req.return_token_strs:
        strs = [tok.decode([t], skip_special_tokens=False) for t in ids]
    max_len = h.engine.info.max_model_len
    return {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs}


def _detokenize(h: _Handler, req: DetokenizeRequest) -> dict[str, str]:
    tok = _tokenizer(h, req.model)
    bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
    if bad:
        message = f"token ids out of the vocabulary (0..{tok.vocab_size - 1}): {bad[:5]}"
        raise invalid_request(message, param="tokens")
    return {"prompt": tok.decode(req.tokens)}


def build_app(
    engine: AsyncLLM | EngineCoreClient,
    model_name: str | None = None,
    options: ServeOptions | None = None,
) -> EngineApp:
    """An OpenAI-compatible app over `engine`, serving it as `model_name` (default: dir name)."""
    options = options or ServeOptions()
    names = options.served_model_names or [model_name or engine.model_name]
    app = EngineApp(title="flashstack engine")
    h = _Handler(engine, names, ServerMetrics(engine.stats, names[0]))
    app.state.handler = h
    app.state.drain = drain = Drain(options.drain_timeout_s)
    edge = {"drain": drain, "api_key": options.api_key, "max_body_bytes": options.max_body_bytes}
    app.add_middleware(EdgeMiddleware, **edge)  # the routes FastAPI serves: /tokenize, ...
    routes = {
        "/v1/completions": _post_route(h, CompletionRequest, _completions),
        "/v1/chat/completions": _post_route(h, ChatRequest, _chat),
    }
    app.set_fast_routes(routes, options, drain)

    @app.exception_handler(GatewayError)
    async def _api_error(_: Request, exc: GatewayError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_invalid(exc.errors(), skip=1))  # loc[0] is FastAPI's "body"

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "flashstack",
                    "max_model_len": engine.info.max_model_len,
                }
                for name in h.model_names
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(h.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeChatRequest | TokenizeCompletionRequest) -> dict[str, Any]:
        return _tokenize(h, req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        return _detokenize(h, req)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # EngineApp serves every POST to these two before FastAPI sees it; the routes stay for the
    # OpenAPI schema, 405 to other methods and the trailing-slash redirect.
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        return await _completions(h, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest) -> Any:
        return await _chat(h, req)

    return app


def _invalid(errors: Sequence[Any], skip: int = 0) -> GatewayError:
    """pydantic's validation errors as one 400 naming the first fields (`skip`: loc prefixes)."""

    def where(e: Any) -> str:
        return ".".join(str(x) for x in e["loc"][skip:])

    msg = "; ".join(f"{where(e)}: {e['msg']}" if where(e) else e["msg"] for e in errors[:5])
    return invalid_request(msg or "invalid request", (where(errors[0]) if errors else None) or None)


_Body = TypeVar("_Body", CompletionRequest, ChatRequest)


def _post_route(
    h: _Handler, body: type[_Body], run: Callable[[_Handler, _Body], Awaitable[Any]]
) -> PostRoute:
    """A generation route for EngineApp's direct dispatch: the body parsed by pydantic from the
    raw bytes, every request error a 4xx in OpenAI's shape, a reply dict written by orjson."""

    async def route(raw: bytes) -> ASGIApp:
        try:
            req = body.model_validate_json(raw)
        except ValidationError as exc:
            return _error_response(_invalid(exc.errors()))
        try:
            result = await run(h, req)
        except GatewayError as exc:
            return _error_response(exc)
        if isinstance(result, dict):
            return Response(orjson.dumps(result), media_type="application/json")
        return result  # a stream

    return route


def serve(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    options: ServeOptions | None = None,
    **engine_kwargs: Any,
) -> None:
    """Load the model and serve it until stopped (`flashstack engine serve --model PATH`).

    The engine core steps in a child process (core_process.py), so HTTP work never holds up a
    step. SIGTERM drains: new requests get 503 while running ones finish, then the process exits.
    """
    import uvicorn

    options = options or ServeOptions()
    engine = EngineCoreClient(model_path, **engine_kwargs)
    try:
        app = build_app(engine, model_name, options)
        config = uvicorn.Config(
            app, host=host, port=port, log_level="info", access_log=options.access_log
        )
        app.state.handler.prepare_grammars()
        freeze_startup_heap()
        DrainingServer(config, app.state.drain).run()
    finally:
        engine.close()
