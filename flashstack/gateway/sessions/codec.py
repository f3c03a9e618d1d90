"""Canonical message parts ↔ the JSON stored in the database and shown by the sessions API."""

from __future__ import annotations

from typing import Any

from flashstack.gateway.core import Image, Opaque, Part, RedactedThinking, Text, Thinking, ToolCall, ToolResult, Usage


def part_json(p: Part) -> dict[str, Any]:
    """One part as JSON: {"type": "text" | "image" | "tool_call" | "tool_result" | "thinking", …}."""
    if isinstance(p, Text):
        return {"type": "text", "text": p.text}
    if isinstance(p, Image):
        return {"type": "image", "media_type": p.media_type, "data": p.data, "url": p.url}
    if isinstance(p, ToolCall):
        return {"type": "tool_call", "id": p.id, "name": p.name, "arguments": p.arguments}
    if isinstance(p, ToolResult):
        return {
            "type": "tool_result", "tool_call_id": p.tool_call_id, "is_error": p.is_error,
            "content": [part_json(c) for c in p.content],
        }
    if isinstance(p, RedactedThinking):
        return {"type": "redacted_thinking", "data": p.data}
    if isinstance(p, Opaque):
        return {"type": "opaque", "wire": p.wire, "block": p.block}
    return {"type": "thinking", "text": p.text, "signature": p.signature}


def part_from_json(d: dict[str, Any]) -> Part:
    kind = d["type"]
    if kind == "text":
        return Text(d["text"])
    if kind == "image":
        return Image(d.get("media_type"), d.get("data"), d.get("url"))
    if kind == "tool_call":
        return ToolCall(d["id"], d["name"], d["arguments"])
    if kind == "tool_result":
        content = [part_from_json(c) for c in d["content"]]
        return ToolResult(d["tool_call_id"], content, d.get("is_error", False))  # type: ignore[arg-type]
    if kind == "redacted_thinking":
        return RedactedThinking(d["data"])
    if kind == "opaque":
        return Opaque(d["wire"], d["block"])
    return Thinking(d["text"], d.get("signature"))


def parts_json(parts: list[Part]) -> list[dict[str, Any]]:
    return [part_json(p) for p in parts]


def parts_from_json(items: list[dict[str, Any]]) -> list[Part]:
    return [part_from_json(d) for d in items]


def usage_json(u: Usage) -> dict[str, int]:
    return {
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "cache_read_input_tokens": u.cache_read_input_tokens,
        "cache_creation_input_tokens": u.cache_creation_input_tokens,
    }


def usage_from_json(d: dict[str, Any] | None) -> Usage:
    return Usage(**d) if d else Usage()
