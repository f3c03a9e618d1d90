"""Canonical messages ↔ the JSON stored in the database and shown by the sessions API.

A stored message keeps every field its wire gave it (cache_control, extras, string or list
content), so that its history goes back upstream as the client sent it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson

from flashstack.gateway.core import (
    Image,
    Message,
    Opaque,
    Part,
    RedactedThinking,
    Role,
    Text,
    Thinking,
    ToolCall,
    ToolResult,
    Usage,
)

ANTHROPIC = "anthropic"  # the one wire with prompt caching: cache_control goes only there
OPENAI = "openai"

# What an OpenAI request's assistant message takes beside its parts (content and tool_calls stay
# when they rendered to nothing); a reply's other keys (annotations, reasoning) are reply-only.
_OPENAI_REQUEST_KEYS = frozenset(
    {"content", "tool_calls", "name", "refusal", "audio", "function_call"}
)
# DeepSeek's thinking mode answers 400 unless a tool-calling turn's reasoning_content comes back
# (OpenRouter asks the same of reasoning_details): those turns keep it, others drop it.
_TOOL_TURN_REASONING_KEYS = frozenset({"reasoning_content", "reasoning", "reasoning_details"})


def part_json(p: Part) -> dict[str, Any]:
    """One part as JSON: {"type": "text" | "image" | "tool_call" | "tool_result" | "thinking", …},
    with its `cache_control` and `extra` where it has them."""
    if isinstance(p, Text):
        return _marked({"type": "text", "text": p.text}, p)
    if isinstance(p, Image):
        return _marked(
            {"type": "image", "media_type": p.media_type, "data": p.data, "url": p.url}, p
        )
    if isinstance(p, ToolCall):
        return _marked(
            {"type": "tool_call", "id": p.id, "name": p.name, "arguments": p.arguments}, p
        )
    if isinstance(p, ToolResult):
        body = {
            "type": "tool_result",
            "tool_call_id": p.tool_call_id,
            "is_error": p.is_error,
            "content": [part_json(c) for c in p.content],
        }
        if not p.plain:
            body["plain"] = False
        return _marked(body, p)
    if isinstance(p, RedactedThinking):
        return {"type": "redacted_thinking", "data": p.data}
    if isinstance(p, Opaque):
        return {"type": "opaque", "wire": p.wire, "block": p.block}
    return _marked({"type": "thinking", "text": p.text, "signature": p.signature}, p)


def _marked(
    body: dict[str, Any], p: Text | Image | ToolCall | ToolResult | Thinking
) -> dict[str, Any]:
    cache_control = getattr(p, "cache_control", None)
    if cache_control is not None:
        body["cache_control"] = cache_control
    if p.extra:
        body["extra"] = p.extra
    return body


def part_from_json(d: dict[str, Any]) -> Part:
    kind, cache, extra = d["type"], d.get("cache_control"), d.get("extra") or {}
    if kind == "text":
        return Text(d["text"], cache, extra)
    if kind == "image":
        return Image(d.get("media_type"), d.get("data"), d.get("url"), cache, extra)
    if kind == "tool_call":
        return ToolCall(d["id"], d["name"], d["arguments"], cache, extra)
    if kind == "tool_result":
        content = [part_from_json(c) for c in d["content"]]
        return ToolResult(
            d["tool_call_id"],
            content,
            d.get("is_error", False),
            cache,
            extra,  # type: ignore[arg-type]
            d.get("plain", True),
        )
    if kind == "redacted_thinking":
        return RedactedThinking(d["data"])
    if kind == "opaque":
        return Opaque(d["wire"], d["block"])
    return Thinking(d["text"], d.get("signature"), extra)


def parts_json(parts: list[Part]) -> list[dict[str, Any]]:
    return [part_json(p) for p in parts]


def parts_from_json(items: list[dict[str, Any]]) -> list[Part]:
    return [part_from_json(d) for d in items]


def message_fields_json(m: Message, wire: str | None) -> str | None:
    """What a stored message keeps beside its parts: the wire its extras are in, its own extras, and
    that its content was a list (None when there is nothing to keep)."""
    fields: dict[str, Any] = {}
    if wire:
        fields["wire"] = wire
    if m.extra:
        fields["extra"] = m.extra
    if not m.plain:
        fields["plain"] = False
    return orjson.dumps(fields).decode() if fields else None


def message_from_row(role: Role, content: str, fields: str | None, reply: bool = False) -> Message:
    """A stored message as a request message: as its wire gave it, and for an upstream's `reply`
    only the keys its wire takes in a request (the stored row keeps them all)."""
    f = orjson.loads(fields) if fields else {}
    parts = parts_from_json(orjson.loads(content))
    extra, wire = f.get("extra") or {}, f.get("wire")
    if reply and wire == OPENAI:
        extra = _openai_request_extra(extra, any(isinstance(p, ToolCall) for p in parts))
    return Message(role, parts, extra, f.get("plain", True), wire)


def _openai_request_extra(extra: dict[str, Any], called: bool) -> dict[str, Any]:
    # Tool calls keep their own keys: Gemini's OpenAI endpoint wants extra_content (its thought
    # signature) back on each call.
    keep = _OPENAI_REQUEST_KEYS | _TOOL_TURN_REASONING_KEYS if called else _OPENAI_REQUEST_KEYS
    kept = {k: v for k, v in extra.items() if k in keep}
    audio = kept.get("audio")
    if isinstance(audio, dict):  # a request names an earlier audio answer by its id alone
        kept["audio"] = {"id": audio["id"]} if "id" in audio else None
    return kept


def for_wire(history: list[Message], wire: str | None, dropped: set[str]) -> list[Message]:
    """`history` for a request of `wire`: a message stored from the other wire loses the fields only
    its own wire knows (named in `dropped`); its typed fields cross as the translators map them."""
    if wire is None:  # made by the gateway: the translators' cross-wire rules apply to every field
        return history
    return [m if m.wire in (None, wire) else _stripped(m, wire, dropped) for m in history]


def _stripped(m: Message, wire: str, dropped: set[str]) -> Message:
    dropped.update(f"messages[].{k}" for k, v in m.extra.items() if v is not None)
    return dataclasses.replace(
        m, parts=[_stripped_part(p, wire, dropped) for p in m.parts], extra={}, wire=wire
    )


def _stripped_part(p: Part, wire: str, dropped: set[str]) -> Part:
    if isinstance(p, RedactedThinking | Opaque):
        return p  # typed, or verbatim in its own wire: the translators map or refuse them
    for k, v in p.extra.items():
        if isinstance(v, dict) and k == "image_url":  # OpenAI's image options (detail)
            dropped.update(f"messages[].content[].image_url.{inner}" for inner in v)
        elif v is not None:
            dropped.add(f"messages[].content[].{k}")
    changes: dict[str, Any] = {"extra": {}}
    if getattr(p, "cache_control", None) is not None and wire != ANTHROPIC:
        dropped.add("messages[].content[].cache_control")
        changes["cache_control"] = None
    if isinstance(p, ToolResult):
        changes["content"] = [_stripped_part(c, wire, dropped) for c in p.content]
    return dataclasses.replace(p, **changes)


def usage_json(u: Usage) -> dict[str, int | str]:
    body: dict[str, int | str] = {
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "cache_read_input_tokens": u.cache_read_input_tokens,
        "cache_creation_input_tokens": u.cache_creation_input_tokens,
    }
    if u.reasoning_tokens:
        body["reasoning_tokens"] = u.reasoning_tokens
    if u.estimated:  # the gateway's count: a replay says so as the first reply did
        body["estimated"] = u.estimated
    return body


def usage_from_json(d: dict[str, Any] | None) -> Usage:
    return Usage(**d) if d else Usage()
