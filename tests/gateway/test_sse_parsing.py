"""Upstream event streams parsed as bytes: events split anywhere by the network still
come out whole."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig
from flashstack.gateway.providers.http import LineSplitter
from tests.fakes.server import FakeServer

WORDS = ["Hel", "lo, ", "wörld", "!"]


def _event(delta: dict, finish: str | None = None, eol: bytes = b"\r\n") -> bytes:
    body = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "split",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + eol + eol


def _stream_bytes() -> bytes:
    """CRLF, LF and CR line ends, a comment, an event name, and non-ASCII text."""
    return b"".join(
        [
            b": keep-alive\r\n\r\n",
            _event({"role": "assistant", "content": ""}),
            _event({"content": WORDS[0]}, eol=b"\n"),
            b"event: message\r" + _event({"content": WORDS[1]}, eol=b"\r"),
            _event({"content": WORDS[2]}),
            _event({"content": WORDS[3]}),
            _event({}, "stop"),
            b"data: [DONE]\r\n\r\n",
        ]
    )


def _pieces(data: bytes) -> list[bytes]:
    """`data` cut at every \\r (between it and its \\n), inside the UTF-8 of ö, and
    every 7 bytes."""
    cuts = {i + 1 for i, b in enumerate(data) if b == 0x0D}
    cuts |= {data.index("ö".encode()) + 1} | set(range(7, len(data), 7))
    bounds = [0, *sorted(c for c in cuts if c < len(data)), len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


async def _split_upstream(request: Request) -> StreamingResponse:
    async def body():
        for piece in _pieces(_stream_bytes()):
            yield piece
            await asyncio.sleep(0.002)  # a write per piece: the gateway reads them one by one

    return StreamingResponse(body(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def split_gateway():
    routes = [Route("/v1/chat/completions", _split_upstream, methods=["POST"])]
    upstream = FakeServer(Starlette(routes=routes)).start()
    cfg = Config(
        models=[
            ModelConfig(
                name="split",
                provider="openai",
                model="split",
                api_base=upstream.url + "/v1",
                api_key="k",
            )
        ]
    )
    with FakeServer(create_app(cfg), lifespan="on", loop="uvloop") as gw:
        yield gw
    upstream.stop()


def test_events_split_anywhere_arrive_whole(split_gateway):
    client = openai.OpenAI(base_url=split_gateway.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="split", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(WORDS)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("ends", [b"\n", b"\r\n", b"\r"])
def test_line_splitter_matches_splitlines_at_every_cut(ends):
    data = ends.join([b"data: a", b"", b"event: x", b"data: \xc3\xb6", b"", b""]) + b"tail"
    expected = data.splitlines()
    for cut in range(len(data) + 1):
        splitter = LineSplitter()
        got = splitter.feed(data[:cut]) + splitter.feed(data[cut:]) + splitter.close()
        assert got == expected, f"cut at {cut}"
