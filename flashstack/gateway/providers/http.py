"""What every HTTP provider shares: one pooled client per upstream, SSE parsing, error mapping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
import httpx
import orjson

from flashstack import __version__
from flashstack.config import ModelConfig
from flashstack.gateway import overhead
from flashstack.gateway.core import ErrorKind, GatewayError
from flashstack.gateway.providers.aiohttp_transport import AiohttpTransport, as_httpx
from flashstack.gateway.tls import upstream_ssl_context

ErrorDecoder = Callable[[int, Any, "float | None"], GatewayError]


class Client:
    """One upstream's pooled connections; the router is the only retry loop.

    Plain http:// upstreams (vLLM, llama.cpp, Ollama, the engine) speak HTTP/1.1, and chat calls go
    straight to aiohttp: httpx's client layer above its transport (URL merging, cookies, request
    building) was a sixth of the gateway's CPU per request (docs/benchmarks.md, "Gateway overhead").
    https upstreams keep httpx for HTTP/2 and the TLS settings. `http` serves the rare calls
    (model lists, health probes) on either.
    """

    def __init__(self, cfg: ModelConfig, headers: dict[str, str]) -> None:
        timeout = httpx.Timeout(cfg.timeout, connect=cfg.connect_timeout)
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200, keepalive_expiry=30)
        verify = upstream_ssl_context(cfg) or True  # upstream mTLS / private CA (gateway/tls.py)
        base = cfg.api_base or ""
        self._direct = AiohttpTransport() if base.startswith("http://") else None
        self.http = httpx.AsyncClient(base_url=base, headers=headers, timeout=timeout, limits=limits,
                                      http2=True, verify=verify, transport=self._direct)
        self._base = base.rstrip("/")
        # httpx would name itself in user-agent; the direct path names the gateway instead.
        self._headers = {"user-agent": f"flashstack/{__version__}", **headers, **_JSON}
        self._timeout = aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout, sock_read=cfg.timeout)

    @asynccontextmanager
    async def post(self, path: str, body: bytes) -> AsyncIterator[Response]:
        """POST `body`; the response once its head is in, closed (or its connection dropped) on exit."""
        if self._direct is None:
            request = self.http.build_request("POST", path, content=body, headers=_JSON)
            response = await self.http.send(request, stream=True)
            try:
                yield HttpxResponse(response)
            finally:
                await response.aclose()
            return
        try:
            resp = await self._direct.session().post(
                self._base + path, data=body, headers=self._headers, timeout=self._timeout,
                allow_redirects=False, compress=None)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise as_httpx(e) from e
        try:
            yield AiohttpResponse(resp)
        finally:
            if resp.content.at_eof():
                resp.release()  # fully read: the connection goes back to the pool
            else:
                resp.close()  # the upstream stops generating when its connection drops

    async def aclose(self) -> None:
        await self.http.aclose()


class Response:
    """An upstream response: status, headers, and the body as bytes arrive (transport errors as httpx's)."""

    status: int
    headers: Mapping[str, str]

    def chunks(self) -> AsyncIterator[bytes]:
        raise NotImplementedError

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])


class HttpxResponse(Response):
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status, self.headers = response.status_code, response.headers

    def chunks(self) -> AsyncIterator[bytes]:
        return self._response.aiter_bytes()

    async def read(self) -> bytes:
        return await self._response.aread()


class AiohttpResponse(Response):
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status, self.headers = response.status, response.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise as_httpx(e) from e

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise as_httpx(e) from e


def make_client(cfg: ModelConfig, headers: dict[str, str]) -> Client:
    """One pooled client per upstream, sending `headers` with every request."""
    return Client(cfg, headers)


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from a Retry-After (or retry-after-ms) header, if any."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return float(ms) / 1000
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


async def error_from_response(response: Response, decode: ErrorDecoder) -> GatewayError:
    body = await response.read()
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = body.decode(errors="replace")
    return decode(response.status, parsed, retry_after(response.headers))


def transport_error(name: str, exc: httpx.HTTPError) -> GatewayError:
    """A canonical error for a failure to talk to the upstream at all."""
    if isinstance(exc, httpx.TimeoutException):
        return GatewayError(ErrorKind.TIMEOUT, f"upstream {name} timed out ({type(exc).__name__})")
    return GatewayError(ErrorKind.UPSTREAM, f"cannot reach upstream {name}: {type(exc).__name__}: {exc}")


@asynccontextmanager
async def open_stream(
    client: Client, name: str, path: str, body: dict[str, Any], decode: ErrorDecoder
) -> AsyncIterator[Response]:
    """POST `body` and yield the streaming response once its status says success."""
    sent = time.perf_counter()
    try:
        async with client.post(path, orjson.dumps(body)) as response:
            overhead.add_upstream(time.perf_counter() - sent)  # time to first byte: the response head
            sent = 0.0
            if response.status >= 400:
                raise await error_from_response(response, decode)
            yield response
    except httpx.HTTPError as e:
        raise transport_error(name, e) from e
    finally:
        if sent:
            overhead.add_upstream(time.perf_counter() - sent)


async def post_json(client: Client, name: str, path: str, body: dict[str, Any], decode: ErrorDecoder) -> Any:
    sent = time.perf_counter()
    try:
        async with client.post(path, orjson.dumps(body)) as response:
            if response.status >= 400:
                raise await error_from_response(response, decode)
            raw = await response.read()
    except httpx.HTTPError as e:
        raise transport_error(name, e) from e
    finally:
        overhead.add_upstream(time.perf_counter() - sent)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise GatewayError(ErrorKind.UPSTREAM, f"upstream {name} sent a body that is not JSON") from e


class LineSplitter:
    """Complete lines of a byte stream fed in pieces, without their \\n, \\r\\n or \\r."""

    __slots__ = ("_rest",)

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._rest + chunk if self._rest else chunk
        held = b""
        if b"\r" in data:
            if data.endswith(b"\r"):  # maybe the first half of a \r\n split across reads
                data, held = data[:-1], b"\r"
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = data.split(b"\n")
        self._rest = lines.pop() + held
        return lines

    def close(self) -> list[bytes]:
        rest, self._rest = self._rest.rstrip(b"\r"), b""
        return [rest] if rest else []


async def lines(response: Response) -> AsyncIterator[bytes]:
    """The body's lines, as they arrive."""
    splitter = LineSplitter()
    async for chunk in response.chunks():
        for line in splitter.feed(chunk):
            yield line
    for line in splitter.close():
        yield line


async def sse_events(response: Response, name: str) -> AsyncIterator[tuple[str, bytes]]:
    """(event name, data) pairs of a server-sent-events body, parsed as bytes arrive."""
    event, data = "", []
    waiting = time.perf_counter()  # the head is in; the wait for the first event is upstream time too
    splitter = LineSplitter()
    try:
        async for chunk in response.chunks():
            for line in splitter.feed(chunk):
                if not line:
                    if data:
                        if waiting:
                            overhead.add_upstream(time.perf_counter() - waiting)
                            waiting = 0.0
                        yield event or "message", data[0] if len(data) == 1 else b"\n".join(data)
                    event, data = "", []
                elif line.startswith(b"data:"):
                    data.append(_field_value(line, 5))
                elif line.startswith(b"event:"):
                    event = line[6:].strip().decode(errors="replace")
        for line in splitter.close():
            if line.startswith(b"data:"):
                data.append(_field_value(line, 5))
        if data:
            yield event or "message", b"\n".join(data)
    except httpx.HTTPError as e:
        raise transport_error(name, e) from e


def _field_value(line: bytes, colon_end: int) -> bytes:
    """An SSE field's value: what follows the colon, less one leading space (the spec's rule)."""
    return line[colon_end + 1 :] if line[colon_end : colon_end + 1] == b" " else line[colon_end:]


def event_json(data: bytes, name: str, what: str) -> Any:
    """One event's JSON payload; an upstream error when it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        try:  # not UTF-8: read it as a text decoder would, with replacement characters
            return orjson.loads(data.decode(errors="replace"))
        except orjson.JSONDecodeError as e:
            raise GatewayError(ErrorKind.UPSTREAM, f"{name} sent {what} that is not JSON") from e


_JSON = {"content-type": "application/json"}
