"""What every fake upstream answers, decided only from the request: one script, three renderings.

Each protocol module reduces its request to a `Prompt` and renders the `Reply` that `decide`
returns. Directives in the last user text (`[[name]]` or `[[name:arg]]`):

    [[status:CODE]]     fail with HTTP CODE before the first byte (429 carries retry-after)
    [[midstream_error]] stream two chunks, then a protocol-level error, then close
    [[big:N]]           stream N bytes of text in 1 KiB chunks as fast as the client reads
    [[slow:S]]          stream one chunk every S seconds for about five minutes
    [[json]]            reply exactly {"name": "Ada", "age": 36}
    [[badjson]]         reply exactly {"name": 5}
    [[max_tokens]]      reply the echo text but stop with the max-tokens reason
    [[think]]           emit a thinking block first (Anthropic, Ollama; OpenAI has no such field)

Without a text-choosing directive: a tool result in the last user turn → "tool said: <result>";
else an image → "image: <media_type> <decoded bytes>"; else tools offered (and tool_choice not
"none") → call the first (or the forced) tool with TOOL_ARGUMENTS; else "echo: <last user text>".
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]

TOOL_ARGUMENTS = {"city": "Paris", "unit": "celsius"}
# Concatenates to json.dumps(TOOL_ARGUMENTS); split where real models split (mid-token, mid-string).
TOOL_ARGUMENT_FRAGMENTS = ('{"city', '": "Par', 'is", "unit"', ': "celsius"}')
JSON_REPLY = '{"name": "Ada", "age": 36}'
BAD_JSON_REPLY = '{"name": 5}'
BIG_CHUNK_BYTES = 1024
SLOW_STREAM_SECONDS = 300.0
DIRECTIVE = re.compile(r"\[\[(\w+)(?::([^\]]*))?\]\]")
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


class BadRequest(ValueError):
    """The request is malformed in a way the real server rejects with a 400; `param` names the
    field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Image:
    media_type: str
    data: bytes


@dataclass
class Prompt:
    """A request reduced to what the script looks at."""

    texts: list[str] = field(default_factory=list)  # every message text, system included
    last_user_text: str = ""
    tool_results: list[str] = field(default_factory=list)  # in the last user turn
    images: list[Image] = field(default_factory=list)  # in the last user turn
    tool_name: str | None = None  # the tool to call, None when no call is allowed
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    think: bool = False

    @property
    def input_tokens(self) -> int:
        return sum(len(t.split()) for t in self.texts)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    fragments: tuple[str, ...]
    call_id: str  # protocol-neutral suffix; renderers add "toolu_" / "call_"


@dataclass
class Reply:
    """What a fake sends: text chunks or one tool call, how it stops, and how it fails."""

    input_tokens: int
    chunks: Iterable[str] = ()  # a list, or a generator for [[big]] / [[slow]]
    tool_call: ToolCall | None = None
    thinking: str | None = None
    stop_reason: StopReason = "end_turn"
    stop_sequence: str | None = None
    fail_status: int | None = None  # HTTP error before the first byte
    fail_after: int | None = None  # chunks sent before a mid-stream error
    interval: float = 0.0  # seconds between chunks

    @property
    def items(self) -> Iterable[str]:
        """The units a stream sends one per event: argument fragments or text chunks."""
        return self.tool_call.fragments if self.tool_call else self.chunks

    def text(self) -> str:
        """The whole text at once (non-stream replies); materialises lazy chunks."""
        self.chunks = list(self.chunks)
        return "".join(self.chunks)

    @property
    def output_tokens(self) -> int:
        """One token per chunk (or argument fragment); lazy replies count only once materialised."""
        if self.tool_call:
            return len(self.tool_call.fragments)
        return len(self.chunks) if isinstance(self.chunks, list) else 0


def directives(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) or "" for m in DIRECTIVE.finditer(text)}


def split_words(text: str) -> list[str]:
    """Chunks a stream sends: each word with the whitespace before it ("a b" → ["a", " b"])."""
    return re.findall(r"\s*\S+\s*$|\s*\S+", text) or ([text] if text else [])


def decode_base64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: invalid base64 data", where) from None


def sniff_media_type(data: bytes) -> str:
    """The image type from its magic bytes, for protocols that send no media type (Ollama)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "application/octet-stream"


def call_id(prompt: Prompt) -> str:
    digest = hashlib.sha256(repr((prompt.texts, prompt.tool_name)).encode()).hexdigest()
    return digest[:24]


def big_chunks(total: int) -> Iterator[str]:
    line = (_ALPHABET * (BIG_CHUNK_BYTES // len(_ALPHABET) + 1))[:BIG_CHUNK_BYTES]
    for start in range(0, total, BIG_CHUNK_BYTES):
        yield line[: min(BIG_CHUNK_BYTES, total - start)]


def slow_chunks(count: int) -> Iterator[str]:
    for i in range(count):
        yield f"tick {i} "


def decide(prompt: Prompt) -> Reply:
    """The reply to `prompt`; see the module docstring for the rules."""
    said = directives(prompt.last_user_text)
    reply = Reply(input_tokens=prompt.input_tokens)
    if "status" in said:
        reply.fail_status = int(said["status"])
        return reply
    if "think" in said or prompt.think:
        reply.thinking = f"thinking about: {prompt.last_user_text}"
    if "midstream_error" in said:
        reply.fail_after = 2
    if "big" in said:
        reply.chunks = big_chunks(int(said["big"]))
        return reply
    if "slow" in said:
        reply.interval = float(said["slow"])
        reply.chunks = slow_chunks(int(SLOW_STREAM_SECONDS / max(reply.interval, 0.001)) + 1)
        return reply
    if "json" in said:
        text = JSON_REPLY
    elif "badjson" in said:
        text = BAD_JSON_REPLY
    elif prompt.tool_results:
        text = "tool said: " + " ".join(prompt.tool_results)
    elif prompt.images:
        text = " ".join(f"image: {i.media_type} {len(i.data)}" for i in prompt.images)
    elif prompt.tool_name:
        reply.tool_call = ToolCall(
            prompt.tool_name, dict(TOOL_ARGUMENTS), TOOL_ARGUMENT_FRAGMENTS, call_id(prompt)
        )
        reply.stop_reason = "tool_use"
        return reply
    else:
        text = "echo: " + prompt.last_user_text
    return _finish_text(reply, text, prompt, forced_max_tokens="max_tokens" in said)


def _finish_text(reply: Reply, text: str, prompt: Prompt, forced_max_tokens: bool) -> Reply:
    hits = [(text.find(s), s) for s in prompt.stop if s and s in text]
    if hits:
        at, sequence = min(hits)
        text = text[:at]
        reply.stop_reason, reply.stop_sequence = "stop_sequence", sequence
    chunks = split_words(text)
    if prompt.max_tokens is not None and len(chunks) > prompt.max_tokens:
        chunks = chunks[: prompt.max_tokens]
        reply.stop_reason, reply.stop_sequence = "max_tokens", None
    if forced_max_tokens:
        reply.stop_reason, reply.stop_sequence = "max_tokens", None
    reply.chunks = chunks
    return reply
