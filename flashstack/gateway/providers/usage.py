"""Usage the gateway counts itself, for a stream whose upstream reported none.

llama.cpp's server sends no usage in a stream, whatever stream_options asks; without a count a
client is told 0 tokens and spend, budgets and tpm limits see nothing. The prompt is counted with
the model's own tokenizer and chat template where the gateway has them (a `local` model, or a
deployment's `tokenizer` naming the GGUF or model directory its upstream serves), the answer as
its text re-encoded; without them, with the gateway's token counter (tokens.counter_for).
`Usage.estimated` names the counter, and the client is told (`flashstack_estimate` in the usage
it gets, docs/protocols.md): these are the gateway's counts, not the upstream's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from flashstack.gateway import tokens
from flashstack.gateway.config import ModelConfig
from flashstack.gateway.core import (
    ChatRequest,
    Event,
    Finish,
    GatewayError,
    TextDelta,
    ThinkingDelta,
    ToolArgsDelta,
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

    def text(self) -> str:
        return "".join(self._parts)


async def counted_finish(finish: Finish, cfg: ModelConfig, request: ChatRequest, answer: AnswerText) -> Finish:
    """`finish` with the gateway's count of the request and answer (in a thread: a tokenizer may load)."""
    usage = await asyncio.to_thread(estimate, cfg, request, answer.text())
    return replace(finish, usage=usage)


def estimate(cfg: ModelConfig, request: ChatRequest, answer: str) -> Usage:
    """The gateway's count of `request`'s prompt and of `answer`, for `cfg`'s model."""
    path = tokens.tokenizer_path(cfg)
    tokenizer = tokens.model_tokenizer(path) if path is not None else None
    if tokenizer is not None and tokenizer.chat_template:
        prompt = _template_tokens(tokenizer, request)
        if prompt is not None:
            return Usage(prompt, len(tokenizer.encode(answer, add_special_tokens=False)), estimated="tokenizer")
    counter = tokens.counter_for(cfg)
    return Usage(tokens.prompt_tokens(counter, request), counter.tokens(answer), estimated=counter.name)


def _template_tokens(tokenizer: object, request: ChatRequest) -> int | None:
    """The prompt's tokens as the model's chat template renders it (as llama.cpp and our engine do);
    None when the template cannot render it (the caller counts another way)."""
    from flashstack.gateway.providers.local import chat_messages, openai_tools

    try:
        messages = chat_messages(request)
        return len(tokenizer.encode_chat(messages, tools=openai_tools(request) or None))  # type: ignore[attr-defined]
    except GatewayError:  # a part no chat template takes (an image)
        return None
    except Exception as e:  # a template that refuses these messages (its raise_exception)
        log.info("the chat template of %s cannot render this request (%s); counting without it", request.model, e)
        return None
