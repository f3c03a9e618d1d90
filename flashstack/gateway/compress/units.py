"""Units (messages kept, summarized or dropped together) and the texts the embedder reads."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashstack.gateway import tokens
from flashstack.gateway.core import Message, Text, ToolCall, ToolResult

if TYPE_CHECKING:
    import numpy as np  # imported where used: 16 MB a gateway that never compresses need not hold

CHUNK_WORDS = 180  # MiniLM reads 256 word pieces; longer messages are embedded in chunks
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


@dataclass(slots=True)
class Unit:
    """Messages [start, end) kept, summarized or dropped as one (a tool call and its results)."""

    start: int
    end: int
    text: str
    tokens: int
    vector: np.ndarray | None = None
    relevance: float = 0.0
    message_texts: tuple[str, ...] = ()  # embedded per message, so stored message embeddings apply


def unit_spans(messages: Sequence[Message]) -> list[tuple[int, int]]:
    """Contiguous spans such that no tool call is ever separated from its results."""
    called_at: dict[str, int] = {}
    reach = list(range(len(messages)))  # reach[i]: the last message that must stay with message i
    for j, msg in enumerate(messages):
        for p in msg.parts:
            if isinstance(p, ToolCall):
                called_at[p.id] = j
            elif isinstance(p, ToolResult) and p.tool_call_id in called_at:
                i = called_at[p.tool_call_id]
                reach[i] = max(reach[i], j)
    spans, start, end = [], 0, -1
    for i in range(len(messages)):
        end = max(end, reach[i])
        if i == end:
            spans.append((start, i + 1))
            start = i + 1
    return spans


def query_index(messages: Sequence[Message]) -> int:
    """The latest user turn with text of its own (not only tool results); else the last message."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "user" and any(isinstance(p, Text) and p.text.strip() for p in m.parts):
            return i
    return len(messages) - 1


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(text) if s and s.strip()]


def chunks(text: str) -> list[str]:
    """Pieces MiniLM can read whole (it truncates at 256 word pieces)."""
    words = text.split()
    if len(words) <= CHUNK_WORDS:
        return [text or " "]
    return [" ".join(words[i : i + CHUNK_WORDS]) for i in range(0, len(words), CHUNK_WORDS)]


def message_texts(m: Message) -> list[str]:
    """Every text the planner may embed for one message: its chunks, then its sentences."""
    text = tokens.message_text(m)
    return list(dict.fromkeys(chunks(text) + split_sentences(text)))
