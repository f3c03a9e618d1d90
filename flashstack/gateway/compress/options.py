"""What the caller asked for: the `compression` field of a request, of a session's metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashstack.gateway.config import CompressionMode
from flashstack.gateway.core import ChatRequest, invalid_request

MODES: tuple[CompressionMode, ...] = ("auto", "off", "truncate")


@dataclass(frozen=True, slots=True)
class Options:
    """The request's `compression` extension: a mode, or {"mode": ..., "pinned": [indexes]}."""

    mode: CompressionMode | None = None
    pinned: frozenset[int] = frozenset()


def request_options(req: ChatRequest) -> Options:
    """Parse `compression` from the request's extension fields; bad values are the caller's 400."""
    raw = req.extensions.get("compression")
    if raw is None:
        return Options()
    if isinstance(raw, str):
        return Options(_mode(raw))
    if not isinstance(raw, dict) or set(raw) - {"mode", "pinned"}:
        raise invalid_request(
            'compression must be "auto", "off", "truncate" or an object '
            '{"mode": ..., "pinned": [indexes]}',
            "compression",
        )
    pinned = raw.get("pinned", [])
    if not isinstance(pinned, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(req.messages)
        for i in pinned
    ):
        raise invalid_request(
            f"compression.pinned must list message indexes between 0 and {len(req.messages) - 1}",
            "compression.pinned",
        )
    mode = raw.get("mode")
    return Options(None if mode is None else _mode(mode), frozenset(pinned))


def shift_pinned(req: ChatRequest, offset: int) -> None:
    """Keep `compression.pinned` pointing at the caller's messages once `offset` stored ones
    precede them."""
    raw = req.extensions.get("compression")
    if offset and isinstance(raw, dict) and raw.get("pinned"):
        req.extensions["compression"] = {**raw, "pinned": [i + offset for i in raw["pinned"]]}


def session_mode(metadata: dict[str, Any]) -> CompressionMode | None:
    """A session's `metadata.compression`, checked (400 at session create/update when it is bad)."""
    value = metadata.get("compression")
    return None if value is None else _mode(value, "metadata.compression")


def _mode(value: Any, param: str = "compression") -> CompressionMode:
    if value not in MODES:
        raise invalid_request(f"{param} must be one of {', '.join(MODES)}; got {value!r}", param)
    return value
