"""What every HTTP provider shares: one pooled client per upstream, bounded reads, SSE parsing."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import aiohttp
import httpx
import orjson

from flashstack import __version__
from flashstack.gateway import overhead, telemetry
from flashstack.gateway.config import ModelConfig
from flashstack.gateway.core import ErrorKind, Exchange, GatewayError, error_for_status
from flashstack.gateway.providers.aiohttp_transport import AiohttpTransport, as_httpx
from flashstack.gateway.providers.upstream import ErrorDecoder, Upstream
from flashstack.gateway.redact import Redactor, split_userinfo
from flashstack.gateway.tls import upstream_ssl_context
from flashstack.gateway.translate.fields import passed_response_headers


class Client:
    """One upstream's pooled connections; the router is the only retry loop.

    Plain http:// upstreams (vLLM, llama.cpp, Ollama, the engine) speak HTTP/1.1, and chat calls go
    straight to aiohttp: httpx's client layer above its transport (URL merging, cookies, request
    building) was a sixth of the gateway's CPU per request (docs/benchmarks.md, "Gateway overhead").
    https upstreams keep httpx for HTTP/2 and the TLS settings. `http` serves the rare calls
    (model lists, health probes) on either.

    Credentials in `api_base` leave the URL, which then appears nowhere: `user:password@` becomes
    basic auth, a query (Azure's `?api-version=…&api-key=…`) is sent with every request.
    """

    def __init__(self, cfg: ModelConfig, headers: dict[str, str], upstream: Upstream) -> None:
        self.upstream = upstream
        base, query, headers = _split_base(cfg, headers)
        timeout = httpx.Timeout(cfg.timeout, connect=cfg.connect_timeout)
        limits = httpx.Limits(
            max_connections=1000, max_keepalive_connections=200, keepalive_expiry=30
        )
        verify = upstream_ssl_context(cfg) or True  # upstream mTLS / private CA (gateway/tls/)
        self._direct = AiohttpTransport() if base.startswith("http://") else None
        self.http = httpx.AsyncClient(
            base_url=base,
            headers=headers,
            params=query,
            timeout=timeout,
            limits=limits,
            http2=True,
            verify=verify,
            transport=self._direct,
        )
        self._base = base.rstrip("/")
        self._query = ("?" + urlencode(query)) if query else ""
        # httpx would name itself in user-agent; the direct path names the gateway instead.
        self._headers = {"user-agent": f"flashstack/{__version__}", **headers, **_JSON}
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=cfg.connect_timeout, sock_read=cfg.timeout
        )

    @asynccontextmanager
    async def post(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> AsyncIterator[Response]:
        """POST `body` (with `headers` besides the client's own); the response once its head is in,
        closed (or its connection dropped) on exit."""
        async with self._send("POST", path, body, None, headers) as response:
            yield response

    async def get_json(self, path: str, timeout: float | None = None) -> Any:
        """GET `path` and its JSON body (bounded by max_body_bytes); every failure a GatewayError.

        Without `timeout`, the deployment's own timeouts: a health probe is bounded by its caller
        (router.health_check_timeout), never by a tighter cap of its own here.
        """
        try:
            async with self._send("GET", path, None, timeout) as response:
                if response.status >= 400:
                    raise self.upstream.failure(
                        error_for_status(response.status, f"HTTP {response.status} for GET {path}")
                    )
                raw = await read_body(response, self.upstream)
        except httpx.HTTPError as e:
            raise self.upstream.transport_error(e) from e
        return parse_json(raw, self.upstream, "a model list")

    @asynccontextmanager
    async def _send(
        self,
        method: str,
        path: str,
        body: bytes | None,
        timeout: float | None,
        headers: dict[str, str] | None = None,
    ) -> AsyncIterator[Response]:
        headers = telemetry.outgoing_headers(headers)  # W3C traceparent of the attempt being traced
        if self._direct is None:
            sent = {**_JSON, **headers} if headers else _JSON if body else None
            request = self.http.build_request(
                method,
                path,
                content=body,
                headers=sent,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
            response = await self.http.send(request, stream=True)
            try:
                yield HttpxResponse(response)
            finally:
                await response.aclose()
            return
        t = self._timeout if timeout is None else aiohttp.ClientTimeout(total=timeout)
        try:
            resp = await self._direct.session().request(
                method,
                self._base + path + self._query,
                data=body,
                timeout=t,
                headers={**self._headers, **headers} if headers else self._headers,
                allow_redirects=False,
                compress=None,
            )
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


def _split_base(
    cfg: ModelConfig, headers: dict[str, str]
) -> tuple[str, list[tuple[str, str]], dict[str, str]]:
    """(base URL without userinfo or query, the query's pairs, headers with basic auth from
    the userinfo)."""
    cfg.check_credentials()  # load_config checked already; a config built in code is checked here
    base, user, password = split_userinfo(cfg.api_base or "")
    if user is not None:
        token = base64.b64encode(f"{user}:{password or ''}".encode()).decode()
        headers = {**headers, "authorization": f"Basic {token}"}
    parts = urlsplit(base)
    query = parse_qsl(parts.query, keep_blank_values=True)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")), query, headers


class Response:
    """An upstream response: status, headers, and the body as bytes arrive (transport
    errors as httpx's)."""

    status: int
    headers: Mapping[str, str]

    def chunks(self) -> AsyncIterator[bytes]:
        raise NotImplementedError

    async def read(self, limit: int, cut: bool = False) -> bytes:
        """The body, read until `limit` bytes: past it BodyTooLarge, or with `cut` the
        first `limit` bytes.

        Checked as the bytes arrive (and against a declared content-length before any): the body is
        never held whole and then measured.
        """
        declared = self.headers.get("content-length", "")
        if not cut and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(int(declared))
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks():
            size += len(chunk)
            if size > limit:
                if not cut:
                    raise BodyTooLarge(size)
                parts.append(chunk[: len(chunk) - (size - limit)])
                break
            parts.append(chunk)
        return b"".join(parts)


class BodyTooLarge(Exception):
    """An upstream body past its cap; `size` is what was seen (or declared) when reading stopped."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class HttpxResponse(Response):
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status, self.headers = response.status_code, response.headers

    def chunks(self) -> AsyncIterator[bytes]:
        return self._response.aiter_bytes()


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


def make_client(cfg: ModelConfig, headers: dict[str, str], upstream: Upstream) -> Client:
    """One pooled client per upstream, sending `headers` with every request."""
    return Client(cfg, headers, upstream)


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


async def read_body(response: Response, upstream: Upstream) -> bytes:
    """A success body, at most max_body_bytes of it; past that a 502."""
    limit = upstream.limits.max_body_bytes
    try:
        return await response.read(limit)
    except BodyTooLarge:
        raise upstream.too_large("a response body", limit, "max_body_bytes") from None


async def error_from_response(
    response: Response, upstream: Upstream, decode: ErrorDecoder
) -> GatewayError:
    """The client-facing error for an error response; only its first max_error_bytes are read."""
    body = await response.read(upstream.limits.max_error_bytes, cut=True)
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = body.decode(errors="replace")
    return upstream.status_error(response.status, parsed, retry_after(response.headers), decode)


def parse_json(raw: bytes, upstream: Upstream, what: str) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise GatewayError(
            ErrorKind.UPSTREAM,
            f"upstream {upstream.name} sent {what} that is not JSON",
            code="upstream_bad_response",
        ) from e


@asynccontextmanager
async def open_stream(
    client: Client,
    path: str,
    body: dict[str, Any],
    decode: ErrorDecoder,
    headers: dict[str, str] | None = None,
    exchange: Exchange | None = None,
) -> AsyncIterator[Response]:
    """POST `body` and yield the streaming response once its status says success."""
    sent = time.perf_counter()
    try:
        async with client.post(path, orjson.dumps(body), headers) as response:
            # time to first byte: the response head
            overhead.add_upstream(time.perf_counter() - sent)
            sent = 0.0
            if exchange is not None:
                exchange.headers = passed_response_headers(response.headers)
            if response.status >= 400:
                raise await error_from_response(response, client.upstream, decode)
            yield response
    except httpx.HTTPError as e:
        raise client.upstream.transport_error(e) from e
    finally:
        if sent:
            overhead.add_upstream(time.perf_counter() - sent)


async def post_json(
    client: Client,
    path: str,
    body: dict[str, Any],
    decode: ErrorDecoder,
    headers: dict[str, str] | None = None,
    exchange: Exchange | None = None,
) -> Any:
    """POST `body` and the JSON of a success response (bounded); errors in the gateway's words.

    With `exchange`, the response headers a client reads (request ids, rate limits) are kept there.
    """
    sent = time.perf_counter()
    try:
        async with client.post(path, orjson.dumps(body), headers) as response:
            if exchange is not None:
                exchange.headers = passed_response_headers(response.headers)
            if response.status >= 400:
                raise await error_from_response(response, client.upstream, decode)
            raw = await read_body(response, client.upstream)
    except httpx.HTTPError as e:
        raise client.upstream.transport_error(e) from e
    finally:
        overhead.add_upstream(time.perf_counter() - sent)
    return parse_json(raw, client.upstream, "a body")


class LineTooLong(Exception):
    """A stream line past the splitter's cap."""


class LineSplitter:
    """Complete lines of a byte stream fed in pieces, without their \\n, \\r\\n or \\r.

    Linear in the bytes fed: a line split over many reads is joined once, when it ends; a line
    longer than `max_line` raises LineTooLong as soon as its length passes the cap.
    """

    __slots__ = ("_after_cr", "_max", "_parts", "_size")

    def __init__(self, max_line: int = 1 << 62) -> None:
        self._parts: list[bytes] = []  # the unfinished line, in pieces
        self._size = 0
        self._max = max_line
        # the last piece ended in \r: a \n starting the next one belongs to it
        self._after_cr = False

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._after_cr:
            self._after_cr = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        if b"\r" in chunk:
            self._after_cr = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = chunk.split(b"\n")
        rest = lines.pop()
        if lines:
            if self._parts:  # the first line began in an earlier read: joined once, now it ends
                if self._size + len(lines[0]) > self._max:
                    raise LineTooLong
                self._parts.append(lines[0])
                lines[0] = b"".join(self._parts)
                self._parts, self._size = [], 0
            # Only a read longer than the cap can hold a whole line longer than it.
            if len(chunk) > self._max and max(map(len, lines)) > self._max:
                raise LineTooLong
        self._hold(rest)
        return lines

    def _hold(self, piece: bytes) -> None:
        if piece:
            self._size += len(piece)
            if self._size > self._max:
                raise LineTooLong
            self._parts.append(piece)

    def close(self) -> list[bytes]:
        rest = b"".join(self._parts)
        self._parts, self._size = [], 0
        return [rest] if rest else []


async def lines(response: Response, upstream: Upstream) -> AsyncIterator[bytes]:
    """The body's lines, as they arrive; each at most max_line_bytes."""
    splitter = LineSplitter(upstream.limits.max_line_bytes)
    try:
        async for chunk in response.chunks():
            for line in splitter.feed(chunk):
                yield line
    except LineTooLong:
        raise upstream.too_large(
            "a stream line", upstream.limits.max_line_bytes, "max_line_bytes"
        ) from None
    except httpx.HTTPError as e:
        raise upstream.transport_error(e) from e
    for line in splitter.close():
        yield line


async def sse_events(response: Response, upstream: Upstream) -> AsyncIterator[tuple[str, bytes]]:
    """(event name, data) pairs of a server-sent-events body, parsed as bytes arrive.

    A line, and an event's data lines together, are each at most max_line_bytes.
    """
    limit = upstream.limits.max_line_bytes
    event, data, size = "", [], 0
    # the head is in; the wait for the first event is upstream time too
    waiting = time.perf_counter()
    splitter = LineSplitter(limit)
    try:
        async for chunk in response.chunks():
            for line in splitter.feed(chunk):
                if not line:
                    if data:
                        if waiting:
                            overhead.add_upstream(time.perf_counter() - waiting)
                            waiting = 0.0
                        yield event or "message", data[0] if len(data) == 1 else b"\n".join(data)
                    event, data, size = "", [], 0
                elif line.startswith(b"data:"):
                    data.append(_field_value(line, 5))
                    size += len(data[-1]) + 1
                    if size > limit:
                        raise LineTooLong
                elif line.startswith(b"event:"):
                    event = line[6:].strip().decode(errors="replace")
        for line in splitter.close():
            if line.startswith(b"data:"):
                data.append(_field_value(line, 5))
        if data:
            yield event or "message", b"\n".join(data)
    except LineTooLong:
        raise upstream.too_large("a stream line or event", limit, "max_line_bytes") from None
    except httpx.HTTPError as e:
        raise upstream.transport_error(e) from e


def _field_value(line: bytes, colon_end: int) -> bytes:
    """An SSE field's value: what follows the colon, less one leading space (the spec's rule)."""
    return line[colon_end + 1 :] if line[colon_end : colon_end + 1] == b" " else line[colon_end:]


def event_json(data: bytes, upstream: Upstream, what: str) -> dict[str, Any]:
    """One event's JSON object; an upstream error when it is not JSON or not an object."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        try:  # not UTF-8: read it as a text decoder would, with replacement characters
            obj = orjson.loads(data.decode(errors="replace"))
        except orjson.JSONDecodeError as e:
            raise GatewayError(
                ErrorKind.UPSTREAM,
                f"upstream {upstream.name} sent {what} that is not JSON",
                code="upstream_bad_response",
            ) from e
    if not isinstance(obj, dict):
        raise upstream.shape_error(what, f"a JSON {type(obj).__name__}, not an object")
    return obj


class _MaskedURLs(logging.Filter):
    """httpx logs every request's URL at INFO: the query an api_base carries (Azure's
    `api-key`) is masked."""

    _redact = Redactor()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "://" in message:
            record.msg, record.args = self._redact(message), ()
        return True


_JSON = {"content-type": "application/json"}
logging.getLogger("httpx").addFilter(_MaskedURLs())
