"""Documents across wires: Anthropic's `document` block ⇄ OpenAI's `file` content part.

Both carry a PDF by value (base64); Anthropic's plain-text documents become text. A document by
reference (a URL, a Files API id) names storage that only its own API can read: no counterpart.
"""

from __future__ import annotations

from typing import Any

PDF = "application/pdf"
_DATA_URL_PREFIX = "data:application/pdf;base64,"


def document_as_openai(block: dict[str, Any]) -> dict[str, Any] | None:
    """The OpenAI part for an Anthropic document block, or None when it has no counterpart."""
    source = block.get("source")
    if not isinstance(source, dict):
        return None
    kind, data = source.get("type"), source.get("data")
    if kind == "base64" and source.get("media_type") == PDF and isinstance(data, str):
        name = block.get("title") if isinstance(block.get("title"), str) else "document.pdf"
        return {"type": "file", "file": {"filename": name, "file_data": _DATA_URL_PREFIX + data}}
    if kind == "text" and isinstance(data, str):
        return {"type": "text", "text": data}
    return None


def file_as_anthropic(part: dict[str, Any]) -> dict[str, Any] | None:
    """The Anthropic document block for an OpenAI file part, or None when it has no counterpart."""
    file = part.get("file")
    data = file.get("file_data") if isinstance(file, dict) else None
    if not isinstance(data, str) or not data.startswith(_DATA_URL_PREFIX):
        return None  # a file_id, or not a PDF
    block: dict[str, Any] = {
        "type": "document",
        "source": {"type": "base64", "media_type": PDF, "data": data[len(_DATA_URL_PREFIX) :]},
    }
    if isinstance(file.get("filename"), str):
        block["title"] = file["filename"]
    return block
