"""With auth off, a web page the user visits must not be able to drive the local gateway.

Two ways a page gets there without a key. DNS rebinding: the page's own name is re-pointed at
127.0.0.1, so the browser sends it here as same-origin, with that name in `Host`. A cross-site
"simple" request: a form or `fetch(..., {mode: "no-cors"})` POST with a text/plain or form body,
which browsers send without a CORS preflight, with the page's `Origin`. Programs (SDKs, curl) send
neither a foreign Host nor an Origin, so refusing both costs them nothing.
"""

from __future__ import annotations

import fnmatch
import ipaddress
from dataclasses import dataclass

from starlette.types import Scope

from flashstack.gateway.config import Config
from flashstack.gateway.core import ErrorKind, GatewayError

# Content types a browser may POST cross-site without a preflight (the Fetch standard's list).
SIMPLE_CONTENT_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


@dataclass(frozen=True, slots=True)
class BrowserGuard:
    """The Host names and Origins a gateway without authentication answers."""

    bound_host: str
    allowed_hosts: tuple[str, ...]
    allowed_origins: tuple[str, ...]

    @classmethod
    def from_config(cls, config: Config) -> BrowserGuard | None:
        """None when auth is on: a page cannot send the key, so it gets a 401 anyway."""
        if config.auth.enabled:
            return None
        server = config.server
        return cls(
            server.host.lower(),
            tuple(h.lower() for h in server.allowed_hosts),
            tuple(o.lower().rstrip("/") for o in server.allowed_origins),
        )

    def check(self, scope: Scope) -> GatewayError | None:
        """The refusal for this request, or None to serve it."""
        host = origin = content_type = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1")
            elif name == b"origin":
                origin = value.decode("latin-1")
            elif name == b"content-type":
                content_type = value.decode("latin-1")
        if host is not None and not self._host_allowed(_hostname(host)):
            return _refusal(
                f"Host {host!r} is not a name this gateway answers to: without authentication it "
                "serves only loopback, IP addresses and server.host. Add the name to "
                "server.allowed_hosts, or set auth.master_key"
            )
        if origin is not None and not self._origin_allowed(origin, host):
            return _refusal(
                f"cross-origin request from {origin!r} refused: without authentication a web page "
                "may not call the gateway. Add the origin to server.allowed_origins, or set "
                "auth.master_key"
            )
        if scope["method"] == "POST" and content_type is not None and _is_simple(content_type):
            return GatewayError(
                ErrorKind.INVALID_REQUEST,
                status=415,
                param="content-type",
                message=f"Content-Type {content_type.split(';')[0].strip()!r} is not accepted: "
                "send the JSON body with Content-Type: application/json",
            )
        return None

    def _host_allowed(self, name: str) -> bool:
        if name in ("localhost", self.bound_host) or name.endswith(".localhost") or _is_ip(name):
            return True  # rebinding needs a name: an IP address in Host cannot be one
        return (
            any(fnmatch.fnmatchcase(name, p) for p in self.allowed_hosts)
            or "*" in self.allowed_hosts
        )

    def _origin_allowed(self, origin: str, host: str | None) -> bool:
        origin = origin.lower().rstrip("/")
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        # Same origin: the page was served under the Host it calls (which passed the Host check).
        _, sep, authority = origin.partition("://")
        return bool(sep) and host is not None and authority == host.lower()


def _hostname(host: str) -> str:
    """`Host` without its port, lower case, without a trailing dot: "[::1]:8400" → "::1"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_simple(content_type: str) -> bool:
    return content_type.split(";")[0].strip().lower() in SIMPLE_CONTENT_TYPES


def _refusal(message: str) -> GatewayError:
    return GatewayError(ErrorKind.PERMISSION, message)
