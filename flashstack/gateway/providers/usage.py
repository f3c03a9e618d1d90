"""Usage the gateway counts itself, for a reply (streamed or not) whose upstream reported none.

llama.cpp's server sends no usage in a stream, whatever stream_options asks, and a proxy may strip
it from a whole reply; without a count a client is told 0 tokens and spend, budgets and tpm
limits see nothing. The prompt is counted with the model's own tokenizer and chat template where
the gateway has them (a `local` model, or a deployment's `tokenizer` naming the GGUF or model
directory its upstream serves), the answer as its text re-encoded; without them, with the
gateway's token counter (tokens.counter_for). `Usage.estimated` names the counter, and the client
is told (`flashstack_estimate` in the usage it gets, docs/protocols.md): these are the gateway's
counts, not the upstream's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from flashstack.gateway import tokens
from flashstack.gateway.config import ModelConfig
from flashstack.gateway.core import (
    ChatRequest,
    ChatResponse,
    Event,
    Finish,
    GatewayError,
    Part,
    Text,
    TextDelta,
    Thinking,
    ThinkingDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
    Usage,
)

log = logging.getLogger("flashstack.gateway")


class AnswerText:
    """What the model generated, gathered from a stream's events, to count once it ends."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[str] = []

    def feed(self, ev: Event) -> None:
        if isinstance(ev, TextDelta | ThinkingDelta):
            self._parts.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            self._parts.append(ev.name)
        elif isinstance(ev, ToolArgsDelta):
            self._parts.append(ev.fragment)

    @classmethod
    def of(cls, content: list[Part]) -> AnswerText:
        """The answer a whole reply carries."""
        answer = cls()
        for p in content:
            if isinstance(p, Text | Thinking):
                answer._parts.append(p.text)
            elif isinstance(p, ToolCall):
                answer._parts += [p.name, p.arguments]
        return answer

    def text(self) -> str:
        return "".join(self._parts)


async def counted_finish(
    finish: Finish, cfg: ModelConfig, request: ChatRequest, answer: AnswerText
) -> Finish:
    """`finish` with the gateway's count of the request and answer (in a thread: a
    tokenizer may load)."""
    usage = await asyncio.to_thread(estimate, cfg, request, answer.text())
    return replace(finish, usage=usage)


async def counted_response(
    resp: ChatResponse, cfg: ModelConfig, request: ChatRequest
) -> ChatResponse:
    """`resp`, which came without usage, with the gateway's count of the request and its answer."""
    usage = await asyncio.to_thread(estimate, cfg, request, AnswerText.of(resp.content).text())
    return replace(resp, usage=usage)


def estimate(cfg: ModelConfig, request: ChatRequest, answer: str) -> Usage:
    """The gateway's count of `request`'s prompt and of `answer`, for `cfg`'s model."""
    tokenizer = own_tokenizer(cfg)
    if tokenizer is not None:
        prompt = _prompt_tokens_or_none(tokenizer, request)
        if prompt is not None:
            return Usage(
                prompt,
                len(tokenizer.encode(answer, add_special_tokens=False)),
                estimated="tokenizer",
            )
    counter = tokens.counter_for(cfg)
    return Usage(
        tokens.prompt_tokens(counter, request), counter.tokens(answer), estimated=counter.name
    )


def own_tokenizer(cfg: ModelConfig) -> Any:
    """`cfg`'s model's own tokenizer, with its chat template (a local model's, or the one its
    deployment's `tokenizer` names); None without one."""
    path = tokens.tokenizer_path(cfg)
    tokenizer = tokens.model_tokenizer(path) if path is not None else None
    return tokenizer if tokenizer is not None and tokenizer.chat_template else None


def template_tokens(tokenizer: Any, request: ChatRequest) -> int:
    """The prompt's tokens as the model's chat template renders it, tools included (as llama.cpp and
    our engine do). Raises GatewayError for a part no chat template takes (an image), and the
    template's own error where it refuses these messages (its raise_exception)."""
    from flashstack.gateway.providers.local import chat_messages, openai_tools

    return len(tokenizer.encode_chat(chat_messages(request), tools=openai_tools(request) or None))


def _prompt_tokens_or_none(tokenizer: Any, request: ChatRequest) -> int | None:
    """template_tokens, or None where the template cannot render the request (counted otherwise)."""
    try:
        return template_tokens(tokenizer, request)
    except GatewayError:  # a part no chat template takes (an image)
        return None
    except Exception as e:  # a template that refuses these messages (its raise_exception)
        log.info(
            "the chat template of %s cannot render this request (%s); counting without it",
            request.model,
            e,
        )
        return None
