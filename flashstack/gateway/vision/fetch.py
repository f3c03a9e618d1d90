"""Fetching an http(s) image URL for a caller without becoming a way into the gateway's network.

Each hop is resolved first and connected to by the checked IP (with the original Host header and
TLS server name), so a DNS answer cannot change between the check and the connection. Redirects are
followed by hand, every hop checked again; size and time are capped for the whole fetch.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import httpx

from flashstack.gateway.core import ErrorKind, GatewayError, invalid_request

if TYPE_CHECKING:
    from flashstack.gateway.config import ImageURLConfig

Resolver = Callable[[str, int], Awaitable[list[str]]]
_REDIRECTS = (301, 302, 303, 307, 308)


async def system_resolve(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for `host`."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


def is_public(address: str) -> bool:
    """True for globally routable unicast addresses (not loopback, private, link-local, ...)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def host_allowed(host: str, allowed: list[str]) -> bool:
    """`allowed` holds exact host names and `*.domain` wildcards; empty allows every host."""
    host = host.lower().rstrip(".")
    for pattern in allowed:
        pattern = pattern.lower().rstrip(".")
        if host == pattern or (pattern.startswith("*.") and host.endswith(pattern[1:])):
            return True
    return not allowed


async def fetch_image(
    url: str,
    cfg: ImageURLConfig,
    param: str | None,
    *,
    resolve: Resolver = system_resolve,
    transport: httpx.AsyncBaseTransport | None = None,
) -> bytes:
    """The bytes at `url`, or a 4xx GatewayError saying which rule the URL broke."""
    try:
        async with asyncio.timeout(cfg.timeout):
            async with httpx.AsyncClient(
                transport=transport, follow_redirects=False, trust_env=False
            ) as client:
                for _ in range(cfg.max_redirects + 1):
                    target = await _checked(httpx.URL(url), cfg, param, resolve)
                    location = await _get(client, url, target, cfg, param)
                    if isinstance(location, bytes):
                        return location
                    url = location
    except TimeoutError:
        # 400, not 408: SDKs retry a 408, and a slow image host stays slow.
        raise invalid_request(
            f"image URL took longer than {cfg.timeout} s to fetch (vision.urls.timeout)", param
        ) from None
    raise invalid_request(f"image URL redirects more than {cfg.max_redirects} times", param)


async def _checked(
    url: httpx.URL, cfg: ImageURLConfig, param: str | None, resolve: Resolver
) -> httpx.URL:
    """The URL rewritten to a checked IP address."""
    if url.scheme not in ("http", "https") or not url.host:
        raise invalid_request(f"image URL must be http(s), not {str(url)[:100]!r}", param)
    if not host_allowed(url.host, cfg.allowed_hosts):
        raise invalid_request(
            f"image URL host {url.host!r} is not in vision.urls.allowed_hosts", param
        )
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        addresses = await resolve(url.host, port)
    except OSError:
        addresses = []
    # One answer for a name that does not resolve and one that resolves inside the gateway's
    # network: which internal names exist is not the caller's to learn.
    if not addresses or (
        not cfg.allow_private_addresses and not all(is_public(a) for a in addresses)
    ):
        raise _unreachable(url.host, param)
    return url.copy_with(host=addresses[0])


def _unreachable(host: str, param: str | None) -> GatewayError:
    return invalid_request(
        f"image URL host {host!r} cannot be fetched: the gateway fetches only hosts that "
        "resolve to public addresses; send the image as base64 data instead",
        param,
    )


async def _get(
    client: httpx.AsyncClient, url: str, target: httpx.URL, cfg: ImageURLConfig, param: str | None
) -> bytes | str:
    """The body (bytes), or the next URL (str) when the server redirects."""
    original = httpx.URL(url)
    headers = {"host": original.netloc.decode("ascii"), "accept": "image/*"}
    extensions = {"sni_hostname": original.host} if original.scheme == "https" else {}
    try:
        async with client.stream("GET", target, headers=headers, extensions=extensions) as resp:
            if resp.status_code in _REDIRECTS and "location" in resp.headers:
                return str(original.join(resp.headers["location"]))
            if resp.status_code != 200:
                raise invalid_request(f"image URL answered HTTP {resp.status_code}", param)
            return await _read_capped(resp, cfg.max_bytes, param)
    except httpx.HTTPError:
        # The error's text (refused, reset, TLS details) would tell a caller about hosts and ports.
        raise invalid_request(
            "image URL cannot be fetched: the connection failed; "
            "send the image as base64 data instead",
            param,
        ) from None


async def _read_capped(resp: httpx.Response, cap: int, param: str | None) -> bytes:
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise _over_cap(cap, param)
    chunks, size = [], 0
    async for chunk in resp.aiter_bytes():
        size += len(chunk)
        if size > cap:
            raise _over_cap(cap, param)
        chunks.append(chunk)
    return b"".join(chunks)


def _over_cap(cap: int, param: str | None) -> GatewayError:
    return GatewayError(
        ErrorKind.REQUEST_TOO_LARGE,
        f"image URL is larger than {cap} bytes (vision.urls.max_bytes)",
        param=param,
    )
