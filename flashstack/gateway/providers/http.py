"""What every HTTP provider shares: one pooled client per upstream, SSE parsing, error mapping."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import orjson

from flashstack.config import ModelConfig
from flashstack.gateway import overhead
from flashstack.gateway.core import ErrorKind, GatewayError
from flashstack.gateway.providers.aiohttp_transport import AiohttpTransport
from flashstack.gateway.tls import upstream_ssl_context

ErrorDecoder = Callable[[int, Any, "float | None"], GatewayError]


def make_client(cfg: ModelConfig, headers: dict[str, str]) -> httpx.AsyncClient:
    """One pooled HTTP/2-capable client per upstream; the router is the only retry loop."""
    timeout = httpx.Timeout(cfg.timeout, connect=cfg.connect_timeout)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200, keepalive_expiry=30)
    verify = upstream_ssl_context(cfg) or True  # upstream mTLS / private CA (gateway/tls.py)
    # Plain http:// means HTTP/1.1, where aiohttp costs a fifth of httpcore's CPU (docs/benchmarks.md,
    # "Gateway overhead"); https keeps httpx's own transport for HTTP/2 and the TLS settings above.
    plain = (cfg.api_base or "").startswith("http://")
    return httpx.AsyncClient(
        base_url=cfg.api_base or "", headers=headers, timeout=timeout, limits=limits, http2=True,
        verify=verify, transport=AiohttpTransport() if plain else None,
    )


def retry_after(response: httpx.Response) -> float | None:
    """Seconds from a Retry-After (or retry-after-ms) header, if any."""
    ms = response.headers.get("retry-after-ms")
    if ms:
        try:
            return float(ms) / 1000
        except ValueError:
            pass
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


async def error_from_response(response: httpx.Response, decode: ErrorDecoder) -> GatewayError:
    body = await response.aread()
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = body.decode(errors="replace")
    return decode(response.status_code, parsed, retry_after(response))


def transport_error(name: str, exc: httpx.HTTPError) -> GatewayError:
    """A canonical error for a failure to talk to the upstream at all."""
    if isinstance(exc, httpx.TimeoutException):
        return GatewayError(ErrorKind.TIMEOUT, f"upstream {name} timed out ({type(exc).__name__})")
    return GatewayError(ErrorKind.UPSTREAM, f"cannot reach upstream {name}: {type(exc).__name__}: {exc}")


@asynccontextmanager
async def open_stream(
    client: httpx.AsyncClient, name: str, path: str, body: dict[str, Any], decode: ErrorDecoder
) -> AsyncIterator[httpx.Response]:
    """POST `body` and yield the streaming response once its status says success."""
    request = client.build_request("POST", path, content=orjson.dumps(body), headers=_JSON)
    sent = time.perf_counter()
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as e:
        raise transport_error(name, e) from e
    finally:
        overhead.add_upstream(time.perf_counter() - sent)  # time to first byte: the response head
    try:
        if response.status_code >= 400:
            raise await error_from_response(response, decode)
        yield response
    finally:
        await response.aclose()


async def post_json(
    client: httpx.AsyncClient, name: str, path: str, body: dict[str, Any], decode: ErrorDecoder
) -> Any:
    sent = time.perf_counter()
    try:
        response = await client.post(path, content=orjson.dumps(body), headers=_JSON)
    except httpx.HTTPError as e:
        raise transport_error(name, e) from e
    finally:
        overhead.add_upstream(time.perf_counter() - sent)
    if response.status_code >= 400:
        raise await error_from_response(response, decode)
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError as e:
        raise GatewayError(ErrorKind.UPSTREAM, f"upstream {name} sent a body that is not JSON") from e


async def sse_events(response: httpx.Response, name: str) -> AsyncIterator[tuple[str, str]]:
    """(event name, data) pairs of a server-sent-events body, parsed as bytes arrive."""
    event, data = "", []
    waiting = time.perf_counter()  # the head is in; the wait for the first event is upstream time too
    try:
        async for line in response.aiter_lines():
            if not line:
                if data:
                    if waiting:
                        overhead.add_upstream(time.perf_counter() - waiting)
                        waiting = 0.0
                    yield event or "message", "\n".join(data)
                event, data = "", []
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" ") if line[5:6] == " " else line[5:])
            elif line.startswith("event:"):
                event = line[6:].strip()
        if data:
            yield event or "message", "\n".join(data)
    except httpx.HTTPError as e:
        raise transport_error(name, e) from e


_JSON = {"content-type": "application/json"}
