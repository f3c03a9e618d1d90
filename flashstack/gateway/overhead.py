"""The gateway's own time per request, sent as `X-Flashstack-Overhead-Ms` for users to
check in production.

Non-stream: the handler's time minus the time spent waiting on upstreams. Stream: the time until the
response (whose first event has arrived) is handed to the server, minus the upstreams' time to first
byte. Upstream time is added up across retries and fallbacks.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

from starlette.responses import Response

HEADER = "x-flashstack-overhead-ms"


class Clock:
    """When the request started, and how long it has waited on upstreams so far."""

    __slots__ = ("start", "upstream")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.upstream = 0.0


# A mutable Clock, not a float: tasks the router spawns copy the context, and must still add to it.
_current: ContextVar[Clock | None] = ContextVar("flashstack_overhead_clock", default=None)


def start() -> Clock:
    """Start timing the current request."""
    clock = Clock()
    _current.set(clock)
    return clock


def add_upstream(seconds: float) -> None:
    """Count `seconds` spent waiting on an upstream (no-op outside a timed request)."""
    clock = _current.get()
    if clock is not None:
        clock.upstream += seconds


def stamp(clock: Clock, response: Response) -> Response:
    """Set the overhead header on `response` and return it."""
    own = max(0.0, time.perf_counter() - clock.start - clock.upstream)
    response.headers[HEADER] = f"{own * 1000:.3f}"
    return response
