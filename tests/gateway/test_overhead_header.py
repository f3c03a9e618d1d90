"""X-Flashstack-Overhead-Ms: the gateway's own time, with the upstream's wait left out."""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig
from tests.fakes.server import FakeServer

HEADER = "x-flashstack-overhead-ms"
UPSTREAM_WAIT = 0.5  # seconds the slow upstream sits on each request before answering
# The gateway's own time is a few ms; the bound is loose for shared CI cores, yet
# far below the wait.
OWN_TIME_BOUND_MS = 250


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    body = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "slow",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _completions(request: Request):
    """Non-stream: wait, then answer. Stream: send the head at once, the first token
    after the wait."""
    body = await request.json()
    if not body.get("stream"):
        await asyncio.sleep(UPSTREAM_WAIT)
        return JSONResponse(
            {
                "id": "c1",
                "object": "chat.completion",
                "created": 0,
                "model": "slow",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "late"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def events():
        yield b": head sent\n\n"  # flushes the response head before the model "thinks"
        await asyncio.sleep(UPSTREAM_WAIT)
        yield _chunk({"role": "assistant", "content": "late"})
        yield _chunk({}, "stop")
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def slow_gateway():
    upstream = FakeServer(
        Starlette(routes=[Route("/v1/chat/completions", _completions, methods=["POST"])])
    ).start()
    config = Config(
        models=[
            ModelConfig(
                name="slow",
                provider="openai",
                model="slow",
                api_base=upstream.url + "/v1",
                api_key="k",
            )
        ]
    )
    gateway = FakeServer(create_app(config), lifespan="on", loop="uvloop").start()
    yield gateway
    gateway.stop()
    upstream.stop()


def _own_ms(headers) -> float:
    value = headers.get(HEADER)
    assert value is not None, f"no {HEADER} header in {dict(headers)}"
    ms = float(value)
    assert ms >= 0
    return ms


def test_nonstream_header_is_a_part_of_the_client_latency(openai_client):
    t0 = time.perf_counter()
    raw = openai_client.chat.completions.with_raw_response.create(
        model="gpt", messages=[{"role": "user", "content": "hi"}]
    )
    elapsed_ms = (time.perf_counter() - t0) * 1000
    assert raw.parse().choices[0].message.content == "echo: hi"
    assert _own_ms(raw.headers) < elapsed_ms


def test_anthropic_stream_carries_the_header(anthropic_client):
    with anthropic_client.messages.with_streaming_response.create(
        model="claude", max_tokens=32, messages=[{"role": "user", "content": "hi"}], stream=True
    ) as resp:
        own = _own_ms(resp.headers)
        text = "".join(line for line in resp.iter_lines() if "text_delta" in line)
    assert "echo" in text
    assert own < OWN_TIME_BOUND_MS


def test_translated_request_carries_the_header(slow_gateway):
    client = anthropic.Anthropic(
        base_url=slow_gateway.url, api_key="unused", max_retries=0, timeout=20
    )
    raw = client.messages.with_raw_response.create(
        model="slow", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.parse().content[0].text == "late"
    assert _own_ms(raw.headers) < OWN_TIME_BOUND_MS


def test_nonstream_header_leaves_out_the_upstream_wait(slow_gateway):
    client = openai.OpenAI(
        base_url=slow_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=20
    )
    t0 = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model="slow", messages=[{"role": "user", "content": "hi"}]
    )
    assert time.perf_counter() - t0 >= UPSTREAM_WAIT
    assert _own_ms(raw.headers) < OWN_TIME_BOUND_MS


def test_stream_header_leaves_out_the_wait_for_the_first_token(slow_gateway):
    client = openai.OpenAI(
        base_url=slow_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=20
    )
    t0 = time.perf_counter()
    with client.chat.completions.with_streaming_response.create(
        model="slow", messages=[{"role": "user", "content": "hi"}], stream=True
    ) as resp:
        # the gateway answers once the first token is in
        assert time.perf_counter() - t0 >= UPSTREAM_WAIT
        own = _own_ms(resp.headers)
        body = "".join(resp.iter_lines())
    assert "late" in body
    assert own < OWN_TIME_BOUND_MS
