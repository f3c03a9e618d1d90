"""Backpressure (a slow client bounds gateway memory) and prompt cancellation on disconnect."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import yaml

from tests.gateway.conftest import API_KEY

# 4x the 10 MB the requirement names, so a gateway that buffers the stream would show it plainly.
BIG = 40_000_000  # bytes of text the upstream streams as fast as it is allowed to


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gateway_process(upstreams, tmp_path_factory):
    """The gateway as its own process, so its RSS is its own."""
    cfg = {
        "server": {"stream_queue_size": 64},
        "models": [
            {
                "name": "gpt",
                "provider": "openai",
                "model": "m",
                "api_base": upstreams["openai"].url + "/v1",
                "api_key": API_KEY,
            },
            {
                "name": "claude",
                "provider": "anthropic",
                "model": "m",
                "api_base": upstreams["anthropic"].url,
                "api_key": API_KEY,
            },
        ],
    }
    path = tmp_path_factory.mktemp("gw") / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flashstack.cli",
            "serve",
            "--config",
            str(path),
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health/liveness", timeout=0.5).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError(f"gateway did not start: {proc.stderr.read().decode()[-2000:]}")
    yield url, psutil.Process(proc.pid)
    proc.terminate()
    proc.wait(10)


def _raw_stream_request(url: str, body: dict) -> socket.socket:
    """Open a streaming POST on a socket with a tiny receive buffer; the caller
    reads at its pace."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def test_slow_client_keeps_gateway_memory_bounded(gateway_process, upstreams):
    url, proc = gateway_process
    # Warm up allocator and code paths with one small streamed request.
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json={
            "model": "gpt",
            "stream": True,
            "messages": [{"role": "user", "content": "[[big:200000]]"}],
        },
    ) as r:
        assert sum(len(c) for c in r.iter_bytes()) > 200_000
    rss_before = proc.memory_info().rss
    sock = _raw_stream_request(
        url,
        {
            "model": "gpt",
            "stream": True,
            "messages": [{"role": "user", "content": f"[[big:{BIG}]]"}],
        },
    )
    received, peak = 0, rss_before
    try:
        for _ in range(6):  # one small chunk a second
            received += len(sock.recv(1024))
            time.sleep(1.0)
            peak = max(peak, proc.memory_info().rss)
    finally:
        sock.close()
    growth = (peak - rss_before) / 1e6
    assert received > 0
    assert growth < 20, (
        f"gateway RSS grew {growth:.1f} MB while a slow client read a {BIG / 1e6:.0f} MB stream"
    )


@pytest.mark.parametrize("model,fake", [("gpt", "openai"), ("claude", "anthropic")])
def test_client_disconnect_cancels_upstream_within_a_second(
    gateway_process, upstreams, model, fake
):
    url, _ = gateway_process
    srv = upstreams[fake]
    before = len(srv.requests)
    path = "/v1/chat/completions"
    with httpx.Client(base_url=url, timeout=10) as client:
        with client.stream(
            "POST",
            path,
            json={
                "model": model,
                "stream": True,
                "max_tokens": 100000,
                "messages": [{"role": "user", "content": "[[slow:0.1]]"}],
            },
        ) as r:
            it = r.iter_bytes()
            next(it)
            next(it)
            index = len(srv.requests) - 1
            assert index >= before
        closed_at = time.monotonic()
    deadline = closed_at + 3
    while not any(i == index for i, _ in srv.cancelled) and time.monotonic() < deadline:
        time.sleep(0.02)
    cancelled = dict(srv.cancelled)
    assert index in cancelled, "the upstream request was never cancelled"
    assert cancelled[index] - closed_at < 1.0


def test_quiet_upstream_gets_pings_and_the_stream_goes_on(upstreams):
    """While the upstream is silent, Anthropic clients get `ping` events; the stream itself
    survives them."""
    from flashstack.gateway.app import create_app
    from tests.fakes.server import FakeServer
    from tests.gateway.conftest import gateway_config

    cfg = gateway_config(upstreams, stream_ping_interval=0.2)
    body = {
        "model": "gpt",
        "max_tokens": 100,
        "stream": True,
        "messages": [{"role": "user", "content": "[[slow:0.5]]"}],
    }
    with FakeServer(create_app(cfg), lifespan="on", loop="uvloop") as gw:
        events: list[str] = []
        with httpx.stream("POST", gw.url + "/v1/messages", json=body, timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("event: "):
                    events.append(line[7:])
                if events.count("content_block_delta") >= 4:
                    break
    assert events[0] == "message_start"
    assert events.count("content_block_delta") >= 4, events  # the stream outlived the pings
    first_delta = events.index("content_block_delta")
    # pings between the slow deltas, not only the opening one
    assert "ping" in events[first_delta:], events
    assert "error" not in events and "message_stop" not in events


async def test_a_quiet_upstream_after_the_start_still_sends_the_start_before_any_ping() -> None:
    """The start is held back to share a write with the first token; a ping in between must not
    overtake it (Anthropic clients expect message_start first)."""
    from flashstack.gateway.core import Start, TextDelta
    from flashstack.gateway.streaming import sse

    async def upstream():
        yield Start(id="m1", model="x")
        await asyncio.sleep(0.25)  # quiet for longer than the ping interval
        yield TextDelta(0, "hi")

    def encode(ev) -> list[bytes]:
        return [b"start;" if isinstance(ev, Start) else b"delta;"]

    chunks = [c async for c in sse(upstream(), encode, 8, ping=b"ping;", ping_interval=0.05)]
    body = b"".join(chunks)
    assert body.startswith(b"start;"), body
    assert b"ping;" in body and body.endswith(b"delta;"), body
