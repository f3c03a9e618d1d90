"""Fallback across real processes: llama.cpp first, our engine server second, llama.cpp SIGKILLed
under 50 concurrent streams, then restarted.

llama.cpp's server answers one request at a time and queues the rest. One long answer goes first
(its end-of-turn tokens barred, so it cannot end before the kill); once it streams, 49 short ones
follow, and the kill comes when all 50 are in flight on llama.cpp: one stream mid-answer, 49 not
started. Those must finish on the engine server, the one that had started must end with a clean
error event, the breaker must open, and after the restart the background health probe must bring
traffic back long before the breaker's cooldown ends.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import orjson
import pytest

from flashstack.gateway.config import ModelConfig, RouterConfig
from tests.peers.conftest import (
    ENGINE_MODEL,
    LLAMACPP_MODEL,
    LLAMACPP_START_S,
    llamacpp_process,
    start_gateway,
)

STREAMS = 50
MAX_TOKENS = 16  # small: 49 streams land on the engine at once, on 2 shared cores
# The answer llama.cpp is giving at the kill: with SmolLM2's <|endoftext|> and <|im_end|> barred it
# runs to max_tokens, ~40 s at ~40 tokens/s: longer than the 30 s the kill may wait for the 49
# others to be in flight (on CI's loaded cores that took over 10 s, and a 400-token answer ended
# first). Prompt and answer stay inside llama.cpp's context.
LONG_TOKENS = 1500
NO_END_OF_TURN = {"0": -100, "2": -100}
COOLDOWN_S = 300.0  # far past the test: only the health probe can end it
PRIMARY, STANDBY = "smol-llamacpp", "smol-engine"


@dataclass(eq=False)  # compared by identity: which stream, not what it saw
class Outcome:
    """One stream as the client saw it."""

    deployment: str | None = None
    chunks: int = 0  # chunks with content
    first_at: float | None = None
    finish: str | None = None
    error: dict | None = None
    text: str = ""
    events: list[dict] = field(default_factory=list)


@pytest.fixture(scope="module")
def primary(gguf, peer_logs):
    proc = llamacpp_process(gguf, peer_logs, name="llamacpp-fallback").start(LLAMACPP_START_S)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gateway(primary, engine_server, tmp_path_factory):
    # weight 0: the engine is a standby, taking a request only when llama.cpp failed it or is open.
    models = [
        ModelConfig(
            name="smol",
            id=PRIMARY,
            provider="openai",
            model=LLAMACPP_MODEL,
            api_base=primary.url + "/v1",
            supports_images=False,
        ),
        ModelConfig(
            name="smol",
            id=STANDBY,
            provider="openai",
            model=ENGINE_MODEL,
            api_base=engine_server.url + "/v1",
            supports_images=False,
            weight=0,
        ),
    ]
    router = RouterConfig(
        num_retries=1,
        retry_backoff=0,
        breaker_failures=5,
        breaker_min_requests=10**6,
        breaker_cooldown=COOLDOWN_S,
        breaker_max_cooldown=COOLDOWN_S,
        health_check_interval=0.5,
        ttft_timeout=60,
        # llama-cpp-python answers GET /v1/models behind the lock its generations
        # hold: a probe waits for the running answer (the long one: ~10 s alone, over
        # 30 s on cores the rest of the suite keeps busy). A shorter bound would read a
        # busy llama.cpp as down and send the 49 to the standby before the kill; a dead
        # one still fails the probe at once (connection refused).
        health_check_timeout=120.0,
    )
    server = start_gateway(models, router, tmp_path_factory.mktemp("fallback-state"))
    yield server
    server.stop()


def _body(i: int, stream: bool, max_tokens: int = MAX_TOKENS, **extra: object) -> bytes:
    return orjson.dumps(
        {
            "model": "smol",
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
            "messages": [{"role": "user", "content": f"Write a short poem about the number {i}."}],
            **extra,
        }
    )


async def _stream(
    client: httpx.AsyncClient, body: bytes, out: Outcome, first_token: asyncio.Event
) -> None:
    async with client.stream(
        "POST", "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    ) as resp:
        assert resp.status_code == 200, await resp.aread()
        out.deployment = resp.headers.get("x-flashstack-deployment")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            out.events.append(event)
            if "error" in event:
                out.error = event["error"]
                continue
            for choice in event.get("choices", []):
                if choice["delta"].get("content"):
                    out.chunks += 1
                    out.text += choice["delta"]["content"]
                    if out.first_at is None:
                        out.first_at = time.monotonic()
                        first_token.set()
                out.finish = choice.get("finish_reason") or out.finish


def _readiness(gateway) -> dict:
    body = httpx.get(gateway.url + "/health/readiness", timeout=10).json()
    return {d["deployment"]: d for d in body["models"]["smol"]}


async def _until_in_flight(client: httpx.AsyncClient, n: int, timeout: float) -> None:
    """Until the gateway has `n` requests in flight on llama.cpp."""
    deadline = time.monotonic() + timeout
    while True:
        body = (await client.get("/health/readiness")).json()
        ready = {d["deployment"]: d for d in body["models"]["smol"]}
        if ready[PRIMARY]["in_flight"] >= n:
            return
        assert time.monotonic() < deadline, (
            f"{n} streams in flight on llama.cpp within {timeout:g} s: {ready}"
        )
        await asyncio.sleep(0.02)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout:g} s"
        time.sleep(0.1)


def _ask(gateway) -> str:
    """Who served one request; the whole route (every attempt) when it was not the first try."""
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=_body(0, False),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    return (
        r.headers["x-flashstack-deployment"]
        if r.headers["x-flashstack-attempts"] == "1"
        else r.headers["x-flashstack-route"]
    )


def test_sigkill_under_50_streams_fails_over_then_the_probe_brings_traffic_back(gateway, primary):
    assert _ask(gateway) == PRIMARY, "llama.cpp first while it is up"
    outcomes = [Outcome() for _ in range(STREAMS)]
    killed: dict[str, float] = {}

    async def run() -> None:
        long_first = asyncio.Event()

        async def kill_under_50_streams(client: httpx.AsyncClient) -> None:
            await long_first.wait()  # llama.cpp is answering the long one, holding its one lock
            for i, o in enumerate(outcomes[1:], 1):
                tasks.append(
                    asyncio.create_task(_stream(client, _body(i, True), o, asyncio.Event()))
                )
            await _until_in_flight(client, STREAMS, timeout=30)
            primary.kill()
            killed["at"] = time.monotonic()

        limits = httpx.Limits(max_connections=STREAMS + 5)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60, limits=limits) as client:
            long = _body(0, True, LONG_TOKENS, logit_bias=NO_END_OF_TURN)
            tasks = [asyncio.create_task(_stream(client, long, outcomes[0], long_first))]
            try:
                async with asyncio.timeout(90):  # nothing may hang
                    await kill_under_50_streams(client)
                    await asyncio.gather(*tasks)
            except TimeoutError:
                pytest.fail(
                    f"streams hung (killed: {killed}): "
                    + "; ".join(
                        f"{o.deployment} chunks={o.chunks} finish={o.finish} error={o.error}"
                        for o in outcomes
                        if o.finish is None and o.error is None
                    )
                )

    asyncio.run(run())
    at = killed["at"]
    started = [o for o in outcomes if o.first_at is not None and o.first_at <= at]
    not_started = [o for o in outcomes if o not in started]
    # The stream llama.cpp was answering: its first token, then a clean error event in
    # OpenAI's format.
    assert started == [outcomes[0]], [(o.deployment, o.chunks, o.finish) for o in started]
    cut = started[0]
    assert (cut.deployment, cut.finish) == (PRIMARY, None) and cut.chunks >= 1, (
        cut.deployment,
        cut.events,
    )
    assert cut.error is not None and cut.error["message"] and cut.error["type"], cut.events[-1]
    assert "error" in cut.events[-1], "the error event ends the stream"
    # Every other stream was still queued in llama.cpp: each finished whole on the engine server.
    assert {o.deployment for o in not_started} == {STANDBY}
    assert all(
        o.error is None and o.finish in ("stop", "length") and o.text for o in not_started
    ), [(o.finish, o.error) for o in not_started if o.error or not o.finish]

    ready = _readiness(gateway)
    assert ready[PRIMARY]["breaker"] == "open" and ready[PRIMARY]["cooldown_s"] > COOLDOWN_S - 60, (
        ready[PRIMARY]
    )
    _wait_for(lambda: _readiness(gateway)[PRIMARY]["detail"], 5, "the probe sees llama.cpp down")
    assert _ask(gateway) == STANDBY, "the open breaker keeps traffic on the engine"

    primary.start(LLAMACPP_START_S)  # the same port: the gateway's config has not changed
    t0 = time.monotonic()
    _wait_for(
        lambda: _readiness(gateway)[PRIMARY]["breaker"] != "open",
        10,
        "the health probe ends the cooldown",
    )
    assert time.monotonic() - t0 < 10 < COOLDOWN_S
    assert _ask(gateway) == PRIMARY, "the first request after the probe is llama.cpp's trial"
    assert _readiness(gateway)[PRIMARY]["breaker"] == "closed"
    assert [_ask(gateway) for _ in range(3)] == [PRIMARY] * 3
