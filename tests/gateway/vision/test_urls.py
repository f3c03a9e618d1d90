"""http(s) image URLs: fetched only when enabled, only from allowed public hosts, capped in
size and time."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from flashstack.gateway.config import ImageURLConfig
from flashstack.gateway.core import GatewayError
from flashstack.gateway.vision.fetch import fetch_image, host_allowed, is_public
from tests.gateway.vision.conftest import MAX_IMAGE_BYTES
from tests.gateway.vision.images import image_bytes
from tests.gateway.vision.upstream_view import chat_request_count

PNG = image_bytes("image/png")


def _openai_url(gateway_url: str, image_url: str, model: str = "gpt") -> httpx.Response:
    part = {"type": "image_url", "image_url": {"url": image_url}}
    body = {"model": model, "messages": [{"role": "user", "content": [part]}]}
    return httpx.post(gateway_url + "/v1/chat/completions", json=body, timeout=20)


def _anthropic_url(gateway_url: str, image_url: str, model: str) -> httpx.Response:
    block = {"type": "image", "source": {"type": "url", "url": image_url}}
    body = {"model": model, "max_tokens": 10, "messages": [{"role": "user", "content": [block]}]}
    return httpx.post(gateway_url + "/v1/messages", json=body, timeout=20)


# ---- through the gateway ------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["claude", "gpt", "llama"])
def test_allowed_url_is_fetched_and_sent_by_value(url_gateway, image_host, upstreams, model):
    r = _anthropic_url(url_gateway.url, image_host.url + "/cat.png", model)
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == f"image: image/png {len(PNG)}"


def test_redirect_is_followed_and_checked(url_gateway, image_host):
    r = _openai_url(url_gateway.url, image_host.url + "/redirect")
    assert r.json()["choices"][0]["message"]["content"] == f"image: image/png {len(PNG)}"


@pytest.mark.parametrize(
    "path,status,needle",
    [
        ("/big.png", 413, "vision.urls.max_bytes"),
        ("/missing.png", 400, "HTTP 404"),
    ],
)
def test_url_failures(url_gateway, image_host, upstreams, path, status, needle):
    before = chat_request_count(upstreams)
    r = _openai_url(url_gateway.url, image_host.url + path)
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text
    assert chat_request_count(upstreams) == before


def test_host_not_on_the_allowlist(url_gateway, image_host):
    r = _openai_url(url_gateway.url, image_host.url.replace("127.0.0.1", "localhost") + "/cat.png")
    assert r.status_code == 400 and "allowed_hosts" in r.json()["error"]["message"]


def test_loopback_refused_when_only_public_addresses_are_allowed(
    public_only_gateway, image_host, upstreams
):
    before = chat_request_count(upstreams)
    for url in (image_host.url + "/cat.png", "http://localhost:1/x.png", "http://[::1]:1/x.png"):
        r = _anthropic_url(public_only_gateway.url, url, "claude")
        assert r.status_code == 400, r.text
        assert "resolve to public addresses" in r.json()["error"]["message"]
    assert chat_request_count(upstreams) == before


# ---- the fetcher, with a fake resolver and transport ---------------------------------------------

DNS = {
    "cdn.example.com": ["93.184.216.34"],
    "evil.example.com": ["10.0.0.5"],
    "rebind.example.com": ["93.184.216.34", "127.0.0.1"],
}


async def _resolve(host: str, port: int) -> list[str]:
    return DNS.get(host, [host])


def _handler(request: httpx.Request) -> httpx.Response:
    assert request.url.host == "93.184.216.34", "must connect to the checked address"
    host = request.headers["host"]
    if request.url.path == "/to-private":
        return httpx.Response(302, headers={"location": "http://evil.example.com/x.png"})
    if request.url.path == "/to-loopback-ip":
        return httpx.Response(301, headers={"location": "http://127.0.0.1/x.png"})
    if request.url.path == "/loop":
        return httpx.Response(302, headers={"location": "/loop"})
    assert host == "cdn.example.com"
    return httpx.Response(200, content=PNG)


def _fetch(url: str, **cfg: object) -> bytes:
    config = ImageURLConfig(enabled=True, max_bytes=MAX_IMAGE_BYTES, **cfg)
    return asyncio.run(
        fetch_image(url, config, "p", resolve=_resolve, transport=httpx.MockTransport(_handler))
    )


def test_fetch_public_host_by_its_checked_address():
    assert _fetch("https://cdn.example.com/cat.png") == PNG


@pytest.mark.parametrize(
    "url,needle",
    [
        ("http://cdn.example.com/to-private", "public addresses"),
        ("http://cdn.example.com/to-loopback-ip", "public addresses"),
        # one bad address in the answer is enough
        ("http://rebind.example.com/x.png", "public addresses"),
        ("http://169.254.169.254/latest/meta-data", "public addresses"),  # cloud metadata
        ("http://cdn.example.com/loop", "redirects more than"),
        ("ftp://cdn.example.com/x.png", "http(s)"),
    ],
)
def test_fetch_refusals(url, needle):
    with pytest.raises(GatewayError) as e:
        _fetch(url)
    assert needle in e.value.message and e.value.status == 400 and e.value.param == "p"


def test_internal_and_unresolvable_hosts_get_the_same_answer():
    """Which internal names resolve is not the caller's to learn."""

    async def no_such_host(host: str, port: int) -> list[str]:
        if host == "nowhere.example.com":
            raise OSError("Name or service not known")
        return DNS.get(host, [host])

    config = ImageURLConfig(enabled=True, max_bytes=MAX_IMAGE_BYTES)
    messages = []
    for host in ("nowhere.example.com", "evil.example.com"):
        with pytest.raises(GatewayError) as e:
            asyncio.run(
                fetch_image(
                    f"http://{host}/x.png",
                    config,
                    "p",
                    resolve=no_such_host,
                    transport=httpx.MockTransport(_handler),
                )
            )
        messages.append(e.value.message.replace(host, "HOST"))
    assert messages[0] == messages[1] and "Name or service" not in messages[0]


def test_fetch_allowlist():
    assert _fetch("https://cdn.example.com/cat.png", allowed_hosts=["*.example.com"]) == PNG
    with pytest.raises(GatewayError, match="allowed_hosts"):
        _fetch("https://cdn.example.com/cat.png", allowed_hosts=["images.example.org"])


def test_fetch_timeout():
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200, content=PNG)

    config = ImageURLConfig(enabled=True, timeout=0.2)
    with pytest.raises(GatewayError, match="longer than 0.2 s"):
        asyncio.run(
            fetch_image(
                "http://cdn.example.com/x",
                config,
                None,
                resolve=_resolve,
                transport=httpx.MockTransport(slow),
            )
        )


@pytest.mark.parametrize(
    "address,public",
    [
        ("93.184.216.34", True),
        ("2606:2800:220:1:248:1893:25c8:1946", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("192.168.0.1", False),
        ("172.16.0.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("::1", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("::ffff:127.0.0.1", False),
        ("224.0.0.1", False),
    ],
)
def test_is_public(address, public):
    assert is_public(address) is public


def test_host_allowed():
    assert host_allowed("a.example.com", [])
    assert host_allowed("A.Example.com.", ["a.example.com"])
    assert host_allowed("x.example.com", ["*.example.com"])
    assert not host_allowed("example.com.evil.org", ["*.example.com"])
    assert not host_allowed("badexample.com", ["*.example.com"])
