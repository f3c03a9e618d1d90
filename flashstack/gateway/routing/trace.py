"""What routing did for one request: its attempts and the deployment that served it, as headers."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from flashstack.gateway import telemetry
from flashstack.gateway.core import Usage


@dataclass(slots=True)
class Attempt:
    deployment: str
    result: str  # "ok", an HTTP status, or "ttft_timeout"
    ms: float


@dataclass(slots=True)
class RouteTrace:
    """What routing did for one request; chat.py turns it into response headers."""

    request_id: str = field(default_factory=lambda: "req_" + uuid.uuid4().hex[:24])
    attempts: list[Attempt] = field(default_factory=list)
    served_by: str | None = None
    usage: Usage | None = None  # the upstream's, once its reply (or the stream's Finish) is in
    ttft_ms: float | None = None  # streams: to the first token of the serving attempt
    error: str | None = None  # streams: why the stream broke off after its first token
    # With `span`, the request's trace: attempts are its children.
    tracing: telemetry.Tracing | None = None
    span: object = None

    @classmethod
    def from_header(cls, request_id: str | None) -> RouteTrace:
        """A trace carrying the client's x-request-id when it sent a sane one."""
        if request_id and len(request_id) <= 128 and request_id.isprintable():
            return cls(request_id)
        return cls()

    def headers(self) -> dict[str, str]:
        h = {"x-request-id": self.request_id, "x-flashstack-attempts": str(len(self.attempts))}
        if self.attempts:
            h["x-flashstack-route"] = " ".join(f"{a.deployment}={a.result}" for a in self.attempts)
        if self.served_by:
            h["x-flashstack-deployment"] = self.served_by
        return h
