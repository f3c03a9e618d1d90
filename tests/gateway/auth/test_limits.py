"""The limiters themselves: sliding windows, retry-after, and Redis shared by several replicas."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from flashstack.gateway.auth import Hold, LocalLimiter, RedisLimiter
from tests.gateway.sessions.support import REDIS_URL, redis_available


async def test_local_window_slides():
    limiter = LocalLimiter(window=0.5)
    assert [await limiter.admit("k", 3, None) for _ in range(3)] == [None] * 3
    wait = await limiter.admit("k", 3, None)
    assert wait is not None and 0 < wait <= 0.5
    await asyncio.sleep(wait + 0.05)
    assert await limiter.admit("k", 3, None) is None
    assert await limiter.admit("other", 3, None) is None  # keys do not share windows


def _hold(tokens: int) -> Hold:
    return Hold(uuid.uuid4().hex, tokens)


async def test_local_tokens_per_minute():
    limiter = LocalLimiter(window=0.5)
    first = _hold(40)
    assert await limiter.admit("k", None, 100, first) is None
    await limiter.settle("k", first, 60)  # used more than it held: the window counts what was used
    second = _hold(40)
    assert await limiter.admit("k", None, 100, second) is None  # 60 + 40 ≤ 100: admitted
    await limiter.settle("k", second, 60)
    wait = await limiter.admit("k", None, 100, _hold(40))  # 120 + 40 > 100 until the first 60 leave
    assert wait is not None and 0 < wait <= 0.5
    await asyncio.sleep(wait + 0.05)
    assert await limiter.admit("k", None, 100, _hold(40)) is None


@pytest.fixture
async def replicas():
    if not redis_available():
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    prefix = f"fs-test-{uuid.uuid4().hex[:8]}:"
    limiters = [RedisLimiter(REDIS_URL, prefix), RedisLimiter(REDIS_URL, prefix)]
    yield limiters
    keys = await limiters[0].redis.keys(prefix + "*")
    if keys:
        await limiters[0].redis.delete(*keys)
    for limiter in limiters:
        await limiter.aclose()


@pytest.mark.redis
async def test_redis_limit_holds_across_replicas(replicas):
    # 150 concurrent requests at a 100 rpm key, spread over two replicas: exactly 100 admitted.
    results = await asyncio.gather(
        *(replicas[i % 2].admit("key_shared", 100, None) for i in range(150))
    )
    admitted = [r for r in results if r is None]
    assert len(admitted) == 100
    assert all(0 < r <= 60 for r in results if r is not None)


@pytest.mark.redis
async def test_redis_tokens_shared_across_replicas(replicas):
    a, b = replicas
    first, second = _hold(300), _hold(300)
    assert await a.admit("key_t", None, 1000, first) is None
    await a.settle("key_t", first, 600)
    assert await b.admit("key_t", None, 1000, second) is None
    await b.settle("key_t", second, 600)
    wait = await a.admit("key_t", None, 1000, _hold(300))
    assert wait is not None and 50 < wait <= 60
