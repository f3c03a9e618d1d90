"""A 100 MB base64 image is refused fast, with bounded memory, and the gateway keeps serving."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from tests.gateway.vision.conftest import MAX_IMAGE_BYTES, _start, vision_config
from tests.gateway.vision.images import b64, image_bytes

HUNDRED_MB = 100 * 1024 * 1024
CHUNK = b"A" * (1024 * 1024)  # one shared 1 MiB block: the client itself holds almost nothing


PREFIX = (
    b'{"model": "gpt", "messages": [{"role": "user", "content": [{"type": "image_url", '
    b'"image_url": {"url": "data:image/png;base64,'
)
SUFFIX = b'"}}]}]}'


def _openai_body_stream(size: int):
    yield PREFIX
    for _ in range(size // len(CHUNK)):
        yield CHUNK
    yield SUFFIX


def _rss() -> int:
    return psutil.Process().memory_info().rss  # the gateway runs in this process, in a thread


def _still_serves(url: str) -> None:
    png = image_bytes("image/png")
    part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(png)}"}}
    body = {"model": "gpt", "messages": [{"role": "user", "content": [part]}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=20)
    assert r.json()["choices"][0]["message"]["content"] == f"image: image/png {len(png)}"


@pytest.mark.parametrize("declared_length", [True, False], ids=["content-length", "chunked"])
def test_100mb_body_over_the_body_limit(vision_gateway, declared_length):
    before, t0 = _rss(), time.monotonic()
    headers = {"content-type": "application/json"}
    if declared_length:
        headers["content-length"] = str(len(PREFIX) + HUNDRED_MB + len(SUFFIX))
    content = _openai_body_stream(HUNDRED_MB)
    try:
        r = httpx.post(
            vision_gateway.url + "/v1/chat/completions",
            content=content,
            headers=headers,
            timeout=30,
        )
    except httpx.HTTPError:  # the gateway may answer and close while the client still sends
        r = None
    if r is not None:
        assert r.status_code == 413 and "server.max_body_bytes" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 20
    assert _rss() - before < 64 * 1024 * 1024
    _still_serves(vision_gateway.url)


@pytest.mark.slow
def test_100mb_image_under_a_raised_body_limit(upstreams):
    """The body limit allows it; the per-image cap refuses it from its length, before decoding."""
    server = _start(upstreams, vision_config(), max_body_bytes=128 * 1024 * 1024)
    try:
        before, t0 = _rss(), time.monotonic()
        r = httpx.post(
            server.url + "/v1/chat/completions",
            content=_openai_body_stream(HUNDRED_MB),
            headers={"content-type": "application/json"},
            timeout=60,
        )
        elapsed, grown = time.monotonic() - t0, _rss() - before
        assert r.status_code == 413, r.text
        assert (
            "vision.max_image_bytes" in r.json()["error"]["message"]
            and str(MAX_IMAGE_BYTES) in r.text
        )
        assert elapsed < 30
        # Body (100 MB) + its JSON string (100 MB) at most, never a decoded copy or pixels.
        assert grown < 450 * 1024 * 1024, f"RSS grew by {grown / 2**20:.0f} MiB"
        _still_serves(server.url)
    finally:
        server.stop()
