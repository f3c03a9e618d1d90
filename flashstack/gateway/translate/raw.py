"""Upstream events kept whole for a client of the same wire (core.Raw), attached as they decode."""

from __future__ import annotations

from typing import Any

from flashstack.gateway.core import SAME_RAW, Raw


class RawTap:
    """Collects an upstream's events and hands them to the next canonical event decoded.

    An upstream event that decodes to nothing (a ping, a usage-only chunk) waits for the next event
    that does, so the client of the same wire gets every event, in order, none twice.
    """

    __slots__ = ("wire", "_pending")

    def __init__(self, wire: str) -> None:
        self.wire = wire
        self._pending: list[tuple[str, dict[str, Any]]] = []

    def add(self, name: str, data: dict[str, Any]) -> None:
        self._pending.append((name, data))

    def take(self) -> Raw:
        """The events waiting since the last take (SAME_RAW when they went with an
        earlier event)."""
        if not self._pending:
            return SAME_RAW
        raw, self._pending = Raw(self.wire, self._pending), []
        return raw


def tap_for(client_wire: str | None, upstream_wire: str) -> RawTap | None:
    """A tap when the client speaks the upstream's wire; None (nothing kept) otherwise."""
    return RawTap(upstream_wire) if client_wire == upstream_wire else None
