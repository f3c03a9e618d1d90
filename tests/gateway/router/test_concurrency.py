"""200 concurrent streams over three deployments; one is killed midway. None may hang."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import openai
import pytest

from tests.gateway.router.conftest import deployment, gateway, new_tag
from tests.gateway.router.faulty import FaultyUpstream

STREAMS = 200
CHUNKS = 20


@pytest.mark.slow
def test_200_streams_survive_a_deployment_killed_midway():
    ups = {n: FaultyUpstream(n, chunks=CHUNKS, interval=0.08).start() for n in "abc"}
    try:
        models = [deployment("m", ups[n], timeout=20) for n in "abc"]
        with gateway(
            models, num_retries=2, breaker_failures=3, breaker_cooldown=30, ttft_timeout=5
        ) as gw:
            results = asyncio.run(_run(gw.url, ups["b"]))
            metrics = httpx.get(gw.url + "/metrics").text
    finally:
        for u in ups.values():
            u.stop()

    outcomes = Counter(r[0] for r in results)
    stats = {"served_by_b": sum(r[2] == "m#1" for r in results), "outcomes": outcomes}
    assert outcomes["hung"] == 0, outcomes
    assert 'flashstack_breaker_state{deployment="m#1"} 2.0' in metrics, (
        "the dead deployment's breaker opened"
    )
    assert outcomes["ok"] + outcomes["error"] == STREAMS
    assert outcomes["ok"] >= STREAMS // 2, outcomes
    assert outcomes["error"] >= 5, "the kill cut streams that had begun"
    # b took ~20 streams before the kill; had it not been skipped afterwards it would
    # serve ~1/3 of 200.
    assert stats["served_by_b"] <= 45, stats
    logs = {n: u.tags() for n, u in ups.items()}
    for kind, tag, served_by, text, _ in results:
        owner = {"m#0": "a", "m#1": "b", "m#2": "c"}[served_by]
        assert logs[owner].count(tag) == 1, "served once by the deployment the header names"
        if kind == "ok":
            assert text == f"{owner}:" + "".join(f" w{i}" for i in range(CHUNKS)), (
                "whole answers only"
            )
        else:
            assert owner == "b", "only streams cut by the kill end in an error event"
        assert sum(tags.count(tag) for tags in logs.values()) <= 3, (
            "never more attempts than allowed"
        )


async def _run(url: str, victim: FaultyUpstream) -> list[tuple[str, str, str, str, int]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
    tasks, killed = [], False
    for _ in range(STREAMS):  # arrivals spread over ~2 s; each stream lasts ~1.6 s
        tasks.append(asyncio.create_task(_one(client, new_tag())))
        await asyncio.sleep(0.01)
        if not killed and len(victim.log) >= 20:
            victim.kill()  # with streams in flight on it, and more to come
            killed = True
    assert killed
    t0 = time.monotonic()
    results = await asyncio.gather(*tasks)
    assert time.monotonic() - t0 < 40
    await client.close()
    return results


async def _one(client: openai.AsyncOpenAI, tag: str) -> tuple[str, str, str, str, int]:
    text, served_by, attempts = [], "?", 0
    try:
        async with asyncio.timeout(30):
            async with client.chat.completions.with_streaming_response.create(
                model="m", stream=True, messages=[{"role": "user", "content": f"go #{tag}"}]
            ) as r:
                served_by = r.headers["x-flashstack-deployment"]
                attempts = int(r.headers["x-flashstack-attempts"])
                async for chunk in await r.parse():
                    text.extend(c.delta.content or "" for c in chunk.choices)
    except TimeoutError:
        return "hung", tag, served_by, "".join(text), attempts
    except openai.APIError:
        return "error", tag, served_by, "".join(text), attempts
    return "ok", tag, served_by, "".join(text), attempts
