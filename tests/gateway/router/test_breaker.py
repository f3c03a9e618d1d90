"""Circuit breakers: the state machine on both stores, and recovery through half-open
over real HTTP."""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from flashstack.gateway.routing.state import BreakerState, MemoryState, RedisState, TripPolicy
from tests.gateway.router.conftest import (
    ask,
    breaker_of,
    deployment,
    gateway,
    new_tag,
    openai_client,
)

POLICY = TripPolicy(failures=3, failure_rate=0.5, window=30, min_requests=6)
REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def store(request):
    s = (
        MemoryState()
        if request.param == "memory"
        else RedisState(REDIS_URL, f"test:{uuid.uuid4().hex}:")
    )
    yield s
    if isinstance(s, RedisState):
        keys = [k async for k in s.redis.scan_iter(match=s.prefix + "*")]
        if keys:
            await s.redis.delete(*keys)
    await s.aclose()


async def state(store, dep="d") -> BreakerState:
    return (await store.snapshot([dep]))[0].state


async def test_consecutive_failures_open_and_a_success_resets_the_count(store):
    for _ in range(2):
        assert not await store.record_failure("d", POLICY, 10)
    await store.record_success("d", POLICY)
    for _ in range(2):
        assert not await store.record_failure("d", POLICY, 10)
    assert await state(store) is BreakerState.CLOSED
    assert await store.record_failure("d", POLICY, 10)
    snap = (await store.snapshot(["d"]))[0]
    assert snap.state is BreakerState.OPEN and 9 < snap.open_for <= 10


async def test_failure_rate_over_the_window_opens(store):
    policy = TripPolicy(failures=100, failure_rate=0.5, window=30, min_requests=6)
    opened = []
    for i in range(6):  # alternate: never two failures in a row, but half of all requests fail
        if i % 2:
            await store.record_success("d", policy)
        else:
            opened.append(await store.record_failure("d", policy, 10))
    assert opened == [False, False, False] and await state(store) is BreakerState.CLOSED
    assert await store.record_failure("d", policy, 10), "4 of 7 failed, over the 50% rate"


async def test_half_open_admits_one_probe_and_closes_on_success(store):
    for _ in range(3):
        await store.record_failure("d", POLICY, 0.2)
    assert await state(store) is BreakerState.OPEN
    await asyncio.sleep(0.3)
    assert await state(store) is BreakerState.HALF_OPEN
    assert await store.try_probe("d", 5)
    assert not await store.try_probe("d", 5), "a single probe"
    assert await store.record_success("d", POLICY)
    assert await state(store) is BreakerState.CLOSED


async def test_half_open_failure_reopens_at_once(store):
    for _ in range(3):
        await store.record_failure("d", POLICY, 0.2)
    await asyncio.sleep(0.3)
    assert await store.try_probe("d", 5)
    assert await store.record_failure("d", POLICY, 0.2), "one failed probe re-opens"
    assert await state(store) is BreakerState.OPEN


async def test_a_passing_health_probe_ends_the_cooldown_and_the_next_request_decides(store):
    for _ in range(3):
        await store.record_failure("d", POLICY, 60)
    assert await store.end_cooldown("d"), "it was open"
    assert await state(store) is BreakerState.HALF_OPEN
    assert not await store.end_cooldown("d"), "half-open is not open"
    assert await store.try_probe("d", 5)
    assert await store.record_success("d", POLICY)
    assert await state(store) is BreakerState.CLOSED
    assert not await store.end_cooldown("d")


async def test_in_flight_counts(store):
    await store.add_in_flight("d", 1)
    await store.add_in_flight("d", 1)
    await store.add_in_flight("e", 1)
    await store.add_in_flight("d", -1)
    assert [s.in_flight for s in await store.snapshot(["d", "e", "f"])] == [1, 1, 0]


# ---- over real HTTP ---------------------------------------------------------------------------


def test_open_breaker_is_skipped_then_recovers_through_half_open(ups):
    models = [deployment("primary", ups["a"], fallbacks=["backup"]), deployment("backup", ups["b"])]
    ups["a"].fail("status", status=503)
    with gateway(models, num_retries=0, breaker_failures=2, breaker_cooldown=0.6) as gw:
        client = openai_client(gw)
        for _ in range(2):
            assert ask(client, "primary", new_tag())[0].startswith("b:")
        assert breaker_of(gw, "primary#0")["breaker"] == "open"
        tag = new_tag()
        text, headers = ask(client, "primary", tag)
        assert text.startswith("b:") and headers["x-flashstack-attempts"] == "1", (
            "skipped, not tried"
        )
        assert tag not in ups["a"].tags()

        ups["a"].heal()
        time.sleep(0.7)
        assert breaker_of(gw, "primary#0")["breaker"] == "half_open"
        text, headers = ask(client, "primary", new_tag(), stream=True)
        assert text.startswith("a:") and headers["x-flashstack-deployment"] == "primary#0"
        assert breaker_of(gw, "primary#0")["breaker"] == "closed"


def test_half_open_sends_a_single_probe(ups):
    models = [
        deployment("primary", ups["a"], fallbacks=["backup"], timeout=1.5),
        deployment("backup", ups["b"]),
    ]
    ups["a"].fail("status", status=500)
    with gateway(
        models, num_retries=0, breaker_failures=1, breaker_cooldown=0.3, ttft_timeout=1.5
    ) as gw:
        client = openai_client(gw)
        ask(client, "primary", new_tag())
        ups["a"].fail("hang")  # the probe will hang until its timeout
        time.sleep(0.4)
        before = len(ups["a"].log)
        tags = [new_tag() for _ in range(4)]
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda t: ask(client, "primary", t, True), tags))
        assert len(ups["a"].log) - before == 1, "only one request probed the half-open deployment"
        assert all(text.startswith("b:") for text, _ in results)
        assert breaker_of(gw, "primary#0")["breaker"] == "open", "the failed probe re-opened it"
