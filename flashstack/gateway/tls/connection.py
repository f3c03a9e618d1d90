"""uvicorn's HTTP protocol with the TLS peer: its identity into each request's scope, or refused.

A connection whose certificate matches none of `client_names` is closed before any request is read.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from flashstack.gateway.tls.identity import CLIENT_CERT_STATE_KEY, ClientIdentity, peer_identity

log = logging.getLogger("flashstack.tls")

_TLS_VERSIONS = {"TLSv1.2": 0x0303, "TLSv1.3": 0x0304}
Scope = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]


def tls_http_protocol(http: str | type, client_names: list[str]) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class, extended to put the TLS peer into each request's scope."""
    base = _protocol_class(http)

    class TLSHTTPProtocol(base):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            ssl_object = transport.get_extra_info("ssl_object")
            if ssl_object is None:
                return
            identity = peer_identity(ssl_object)
            if client_names and not (identity and identity.matches(client_names)):
                shown = identity.names if identity else "no certificate"
                log.warning(
                    "closed a TLS connection from %s: client certificate %s matches none of "
                    "server.tls.client_names %s",
                    transport.get_extra_info("peername"),
                    shown,
                    client_names,
                )
                self.app = _refuse  # bytes already in flight must not reach the app either
                transport.abort()  # close() would still deliver data read while flushing
                return
            self.app = _with_tls_scope(self.app, _tls_extension(ssl_object, identity), identity)

    TLSHTTPProtocol.__name__ = TLSHTTPProtocol.__qualname__ = f"TLS{base.__name__}"
    return TLSHTTPProtocol


def _protocol_class(http: str | type) -> type:
    if not isinstance(http, str):
        return http
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    return import_from_string(HTTP_PROTOCOLS.get(http, http))


def _tls_extension(ssl_object: Any, identity: ClientIdentity | None) -> dict[str, Any]:
    # The ASGI TLS extension (asgiref "TLS Extension"); ssl does not expose the cipher suite id.
    der = ssl_object.getpeercert(True)
    return {
        "server_cert": None,
        "client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)] if der else [],
        "client_cert_name": identity.subject if identity else None,
        "client_cert_error": None,
        "tls_version": _TLS_VERSIONS.get(ssl_object.version()),
        "cipher_suite": None,
    }


async def _refuse(scope: Scope, receive: Any, send: Any) -> None:
    await send(
        {"type": "http.response.start", "status": 403, "headers": [(b"connection", b"close")]}
    )
    await send({"type": "http.response.body", "body": b"client certificate not allowed"})


def _with_tls_scope(
    app: ASGIApp, extension: dict[str, Any], identity: ClientIdentity | None
) -> ASGIApp:
    async def tls_app(scope: Scope, receive: Any, send: Any) -> None:
        extensions = scope.get("extensions") or {}
        extensions["tls"] = extension
        scope["extensions"] = extensions
        if identity is not None:
            scope.setdefault("state", {})[CLIENT_CERT_STATE_KEY] = identity
        await app(scope, receive, send)

    return tls_app
