"""How an upstream's failures reach the client: in the gateway's words, naming the deployment.

An upstream's body is data, never a message to relay: an auth failure becomes a 502 (the client's
own key was fine), any upstream text is redacted and cut to an excerpt, and a body of the wrong
shape is the upstream's fault (a 502 that counts against it), never a 500 or an empty success.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from flashstack.gateway.config import ModelConfig, UpstreamLimits
from flashstack.gateway.core import ErrorKind, GatewayError
from flashstack.gateway.redact import Redactor, excerpt, secrets_of

log = logging.getLogger("flashstack.gateway")
T = TypeVar("T")

ErrorDecoder = Callable[[int, Any, "float | None"], GatewayError]
# What a decoder raises on a payload whose fields are not the types it expects.
SHAPE_ERRORS = (KeyError, TypeError, AttributeError, IndexError, ValueError)
_CREDENTIALS = (ErrorKind.AUTHENTICATION, ErrorKind.PERMISSION)


@dataclass(slots=True)
class Upstream:
    """One deployment's upstream as errors see it: its name (the deployment id), limits
    and redactor."""

    name: str
    limits: UpstreamLimits = field(default_factory=UpstreamLimits)
    redact: Redactor = field(default_factory=Redactor)

    @classmethod
    def of(
        cls, cfg: ModelConfig, limits: UpstreamLimits | None = None, redact: Redactor | None = None
    ) -> Upstream:
        """The view for `cfg`; without a redactor, one for `cfg`'s own credentials."""
        return cls(
            cfg.id or cfg.name, limits or UpstreamLimits(), redact or Redactor(secrets_of([cfg]))
        )

    def failure(self, err: GatewayError) -> GatewayError:
        """The client-facing form of an error the upstream reported (HTTP status or
        in-stream event)."""
        if err.status in (401, 403) or err.kind in _CREDENTIALS:
            return GatewayError(
                ErrorKind.UPSTREAM,
                f"upstream credentials rejected: deployment {self.name} refused the gateway's "
                f"credentials (upstream HTTP {err.status}); the gateway's api_key for it needs "
                "fixing, not yours",
                status=502,
                code="upstream_auth_failed",
            )
        text = excerpt(self.redact(err.message), self.limits.error_excerpt_chars)
        # the gateway's model (or api_base) is wrong upstream: not the caller's 404
        if err.status == 404:
            return GatewayError(
                ErrorKind.UPSTREAM,
                f"upstream {self.name} answered 404: its model or path does not exist there (a "
                f"deployment's model or api_base needs fixing, not your request); it said: {text}",
                status=502,
                code="upstream_not_found",
            )
        return GatewayError(
            err.kind,
            f"upstream {self.name} said: {text}",
            status=err.status,
            code=err.code,
            retry_after=err.retry_after,
        )

    def status_error(
        self, status: int, body: Any, retry_after: float | None, decode: ErrorDecoder
    ) -> GatewayError:
        """The error for an HTTP error response, decoded by the wire's own decoder first."""
        try:
            err = decode(status, body, retry_after)
        except SHAPE_ERRORS:
            err = GatewayError(
                ErrorKind.UPSTREAM, f"HTTP {status}", status=status if status >= 500 else 502
            )
        return self.failure(err)

    def decode(self, feed: Callable[..., Iterable[Any]], *args: Any, what: str) -> list[Any]:
        """`feed(*args)`'s events: the upstream's own errors in its client-facing form, shape
        faults as 502s."""
        try:
            return list(feed(*args))
        except GatewayError as e:
            raise self.failure(e) from None
        except SHAPE_ERRORS as e:
            raise self.shape_error(what, f"{type(e).__name__} {e}") from None

    def translate(self, convert: Callable[[Any], T], body: Any, what: str) -> T:
        """`convert(body)` (a translator reading a checked body), its shape faults as 502s."""
        try:
            return convert(body)
        except SHAPE_ERRORS as e:
            raise self.shape_error(what, f"{type(e).__name__} {e}") from None

    def shape_error(self, what: str, detail: str) -> GatewayError:
        """A 502 for a payload the gateway cannot read as `what`; it counts against the upstream."""
        detail = excerpt(self.redact(detail), 120)
        return GatewayError(
            ErrorKind.UPSTREAM,
            f"upstream {self.name} sent {what} of an unexpected shape ({detail})",
            code="upstream_bad_response",
        )

    def too_large(self, what: str, limit: int, knob: str) -> GatewayError:
        """A 502 for a body or line past its cap (router.upstream_limits.<knob>)."""
        return GatewayError(
            ErrorKind.UPSTREAM,
            f"upstream {self.name} sent {what} over {limit} bytes; the gateway "
            f"stopped reading (router.upstream_limits.{knob})",
            code="upstream_too_large",
        )

    def transport_error(self, exc: httpx.HTTPError) -> GatewayError:
        """A failure to talk to the upstream at all; its address and details go to the log only."""
        log.warning("deployment %s: %s: %s", self.name, type(exc).__name__, self.redact(str(exc)))
        if isinstance(exc, httpx.TimeoutException):
            return GatewayError(
                ErrorKind.TIMEOUT, f"upstream {self.name} timed out ({type(exc).__name__})"
            )
        return GatewayError(
            ErrorKind.UPSTREAM, f"cannot reach upstream {self.name} ({type(exc).__name__})"
        )
