"""The limiters themselves: sliding windows, retry-after, and Redis shared by several replicas."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from flashstack.gateway.auth import LocalLimiter, RedisLimiter
from tests.gateway.sessions.support import REDIS_URL, redis_available


async def test_local_window_slides():
    limiter = LocalLimiter(window=0.5)
    assert [await limiter.admit("k", 3, None) for _ in range(3)] == [None] * 3
    wait = await limiter.admit("k", 3, None)
    assert wait is not None and 0 < wait <= 0.5
    await asyncio.sleep(wait + 0.05)
    assert await limiter.admit("k", 3, None) is None
    assert await limiter.admit("other", 3, None) is None  # keys do not share windows


async def test_local_tokens_per_minute():
    limiter = LocalLimiter(window=0.5)
    assert await limiter.admit("k", None, 100) is None
    await limiter.charge("k", 60)
    assert await limiter.admit("k", None, 100) is None  # 60 < 100: admitted
    await limiter.charge("k", 60)
    wait = await limiter.admit("k", None, 100)  # 120 ≥ 100 until the first 60 leave the window
    assert wait is not None and 0 < wait <= 0.5
    await asyncio.sleep(wait + 0.05)
    assert await limiter.admit("k", None, 100) is None


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
    results = await asyncio.gather(*(replicas[i % 2].admit("key_shared", 100, None) for i in range(150)))
    admitted = [r for r in results if r is None]
    assert len(admitted) == 100
    assert all(0 < r <= 60 for r in results if r is not None)


@pytest.mark.redis
async def test_redis_tokens_shared_across_replicas(replicas):
    a, b = replicas
    assert await a.admit("key_t", None, 1000) is None
    await a.charge("key_t", 600)
    assert await b.admit("key_t", None, 1000) is None
    await b.charge("key_t", 600)
    wait = await a.admit("key_t", None, 1000)
    assert wait is not None and 50 < wait <= 60
