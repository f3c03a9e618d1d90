"""An httpx transport over aiohttp, for plain-HTTP (HTTP/1.1) upstreams: vLLM, llama.cpp,
Ollama, the engine.

Measured (bench/gateway/client_compare.py): httpx's own HTTP/1.1 stack (httpcore on anyio) costs ~5x
the CPU of aiohttp per request. Providers keep speaking httpx (requests, responses, errors), so only
the bytes on the wire move to aiohttp; https upstreams stay on httpx, which offers HTTP/2.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import httpx

# aiohttp computes these itself from the body and URL; sending httpx's copies would duplicate them.
_SKIP = frozenset({b"host", b"content-length", b"transfer-encoding"})


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One pooled aiohttp session, created on first use inside the running loop."""

    def __init__(self, max_connections: int = 1000, keepalive_expiry: float = 30.0) -> None:
        self._limit, self._keepalive = max_connections, keepalive_expiry
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        """The pooled session (providers/http.py sends chat requests on it directly)."""
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._limit, keepalive_timeout=self._keepalive, ttl_dns_cache=300
            )
            # httpx decodes content-encoding itself; aiohttp must hand over the bytes as sent.
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        t = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(
            total=None, connect=t.get("connect"), sock_read=t.get("read")
        )
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.headers.raw
            if k.lower() not in _SKIP
        ]
        try:
            resp = await self.session().request(
                request.method,
                str(request.url),
                headers=headers,
                data=request.content,
                timeout=timeout,
                allow_redirects=False,
                compress=None,
            )
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise as_httpx(e, request) from e
        return httpx.Response(
            resp.status,
            headers=list(resp.raw_headers),
            stream=_Body(resp, request),
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class _Body(httpx.AsyncByteStream):
    """The response body as aiohttp delivers it; closing early drops the connection (the
    upstream stops)."""

    def __init__(self, resp: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._resp, self._request = resp, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise as_httpx(e, self._request) from e

    async def aclose(self) -> None:
        if self._resp.content.at_eof():
            self._resp.release()  # fully read: the connection goes back to the pool
        else:
            self._resp.close()


def as_httpx(e: Exception, request: httpx.Request | None = None) -> httpx.TransportError:
    """httpx's exception for an aiohttp failure, so providers map errors as they always have."""
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(str(e) or "upstream connect timed out", request=request)
    if isinstance(e, aiohttp.ServerTimeoutError | asyncio.TimeoutError):
        return httpx.ReadTimeout(str(e) or "upstream read timed out", request=request)
    if isinstance(e, aiohttp.ClientConnectorError):
        return httpx.ConnectError(str(e), request=request)
    if isinstance(
        e, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError | aiohttp.ClientOSError
    ):
        return httpx.RemoteProtocolError(str(e), request=request)
    return httpx.TransportError(str(e), request=request)
