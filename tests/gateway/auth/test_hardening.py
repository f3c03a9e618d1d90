"""Issue 24, keys and limits: every route but liveness needs a key, and tokens-per-minute limits
hold under concurrency, for aborted streams, and across replicas sharing Redis."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from flashstack.gateway.auth import Hold, LocalLimiter, RedisLimiter, Reservation, request_tokens
from flashstack.gateway.core import ChatRequest, Message, Text, Usage
from tests.gateway.sessions.support import (
    MASTER_KEY,
    REDIS_URL,
    ScratchStore,
    auth_headers,
    create_key,
    gateway_config,
    redis_available,
    start_gateway,
)

GUARDED = ["/v1/models", "/v1/models/gpt", "/metrics", "/health/readiness"]
ANTHROPIC = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return ScratchStore("sqlite", tmp_path_factory.mktemp("hardening"))


@pytest.fixture(scope="module")
def gw(upstreams, store, tmp_path_factory):
    server = start_gateway(gateway_config(upstreams, store, tmp_path_factory.mktemp("state")))
    yield server
    server.stop()


def _chat(url: str, key: str, text: str = "hi", **extra) -> httpx.Response:
    body = {"model": "gpt", "messages": [{"role": "user", "content": text}], **extra}
    return httpx.post(
        url + "/v1/chat/completions", json=body, headers=auth_headers(key), timeout=20
    )


# ---- every route but liveness ----------------------------------------------------------------


@pytest.mark.parametrize("path", GUARDED)
@pytest.mark.parametrize("key", [None, "fsk_not_a_key"])
def test_guarded_routes_refuse_without_a_valid_key(gw, path, key):
    r = httpx.get(gw.url + path, headers=auth_headers(key))
    assert r.status_code == 401, r.text
    assert (
        r.json()["error"]["type"] == "authentication_error"
        and r.json()["error"]["code"] == "invalid_api_key"
    )
    assert "gpt" not in r.text and "deployment" not in r.text  # nothing about the models leaks
    r = httpx.get(gw.url + path, headers={**auth_headers(key), **ANTHROPIC})
    assert r.status_code == 401
    message = r.json()["error"]["message"]
    assert r.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": message},
    }
    # Liveness alone answers anyone; a valid key gets the route.
    assert httpx.get(gw.url + "/health/liveness").json() == {"status": "ok"}
    assert httpx.get(gw.url + path, headers=auth_headers(MASTER_KEY)).status_code == 200


def test_a_key_sees_only_its_models(gw):
    key = create_key(gw.url, name="gpt-only-lister", models=["gpt"])["key"]
    listed = httpx.get(gw.url + "/v1/models", headers=auth_headers(key)).json()
    assert [m["id"] for m in listed["data"]] == ["gpt"] and listed["first_id"] == listed[
        "last_id"
    ] == "gpt"
    assert httpx.get(gw.url + "/v1/models/gpt", headers=auth_headers(key)).json()["id"] == "gpt"
    hidden = httpx.get(gw.url + "/v1/models/claude", headers=auth_headers(key))
    missing = httpx.get(gw.url + "/v1/models/nonexistent", headers=auth_headers(key))
    assert hidden.status_code == missing.status_code == 404
    # as if it did not exist
    assert hidden.json()["error"]["message"] == "model 'claude' does not exist"
    everything = httpx.get(gw.url + "/v1/models", headers=auth_headers(MASTER_KEY)).json()
    assert {m["id"] for m in everything["data"]} == {"gpt", "claude", "minilm"}


def test_readiness_detail_is_for_the_master_key(gw):
    key = create_key(gw.url, name="prober")["key"]
    master = httpx.get(gw.url + "/health/readiness", headers=auth_headers(MASTER_KEY))
    plain = httpx.get(gw.url + "/health/readiness", headers=auth_headers(key))
    assert master.status_code == plain.status_code == 200
    assert set(master.json()["models"]) == {"gpt", "claude"}
    assert plain.json() == {"status": master.json()["status"]}  # no deployment ids, no probe errors
    metrics = httpx.get(gw.url + "/metrics", headers=auth_headers(key))
    assert metrics.status_code == 200 and "flashstack_" in metrics.text


# ---- tokens per minute under concurrency -----------------------------------------------------


def _estimate(text: str, max_tokens: int) -> int:
    """What the gateway holds for one such request (the tpm of the test keys is well above it)."""
    return request_tokens(
        ChatRequest("gpt", [Message("user", [Text(text)])], max_tokens=max_tokens), 1024
    )[1]


async def _open_streams(url: str, key: str, text: str, n: int, max_tokens: int):
    """Start `n` streams at once; returns the client, the admitted (open) responses and the
    refused ones."""
    client = httpx.AsyncClient(timeout=20, limits=httpx.Limits(max_connections=n + 5))
    body = {
        "model": "gpt",
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
    }

    async def one() -> httpx.Response:
        request = client.build_request(
            "POST", url + "/v1/chat/completions", json=body, headers=auth_headers(key)
        )
        return await client.send(request, stream=True)

    responses = await asyncio.gather(*(one() for _ in range(n)))
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    for r in refused:
        await r.aread()
    return client, admitted, refused


async def _first_token_then_abort(responses: list[httpx.Response]) -> None:
    async def one(r: httpx.Response) -> None:
        async for line in r.aiter_lines():
            if '"content":"tick' in line:
                break
        await r.aclose()

    await asyncio.gather(*(one(r) for r in responses))


def _upstream_calls(upstreams, marker: str, since: int) -> list:
    """The requests with `marker` in their body the upstream received from its `since`-th on
    (the upstreams serve the whole session: earlier tests' bodies are not this test's)."""
    return [r for r in upstreams["openai"].requests[since:] if marker.encode() in r.raw]


def _described(calls: list) -> list[str]:
    """The recorded requests as an assertion shows them."""
    return [f"{r.method} {r.path} {r.headers.get('traceparent')} {r.raw[:200]!r}" for r in calls]


async def _until_upstream_cancelled(upstreams, marker: str, n: int, since: int) -> None:
    """Wait until the gateway has closed `n` upstream streams of the requests from the
    `since`-th on (their turns settle a moment later: `_settled`)."""
    log = upstreams["openai"]
    for _ in range(100):
        closed = (i for i, _ in log.cancelled if i >= since)
        if sum(marker.encode() in log.requests[i].raw for i in closed) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the gateway did not close the aborted upstream streams")


def _window(gw, key_id: str) -> tuple[int, int]:
    """(tokens held, tokens counted) of `key_id` in the in-process gateway's limiter."""
    return gw.app.services.auth.limiter.state(key_id)


async def _settled(gw, key_id: str) -> tuple[int, int]:
    """`_window` once nothing is held, or as it is after 5 s: an aborted stream's turn settles
    after the gateway has closed its upstream, on a loaded machine a moment after."""
    for _ in range(100):
        held, used = _window(gw, key_id)
        if held == 0:
            break
        await asyncio.sleep(0.05)
    return _window(gw, key_id)


async def test_concurrent_requests_on_a_tpm_key_admit_only_what_fits(gw, upstreams):
    # 20 streams at once on a tpm=30 key: each holds its estimate until it ends, so only as many as
    # fit in 30 reach the upstream; the rest get 429 with retry-after, in the caller's format.
    created = create_key(gw.url, name="tpm-burst", tpm=30)
    key, marker = created["key"], uuid.uuid4().hex[:4]
    since = len(upstreams["openai"].requests)
    text, max_tokens = f"[[slow:0.2]] {marker}", 1
    hold = _estimate(text, max_tokens)
    fit = 30 // hold
    assert 2 <= fit < 20
    client, admitted, refused = await _open_streams(gw.url, key, text, 20, max_tokens)
    try:
        assert len(admitted) == fit and len(refused) == 20 - fit
        for r in refused:
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            assert int(r.headers["retry-after"]) >= 1 and "tokens" in r.json()["error"]["message"]
        calls = _upstream_calls(upstreams, marker, since)
        assert len(calls) == fit, _described(calls)  # nothing refused went upstream
        # Abort each admitted stream after its first token: each is charged what it held.
        await _first_token_then_abort(admitted)
    finally:
        await client.aclose()
    await _until_upstream_cancelled(upstreams, marker, fit, since)
    held, used = await _settled(gw, created["id"])
    assert held == 0 and used >= fit * hold  # settled, each at least what it held
    r = await asyncio.to_thread(_chat, gw.url, key, "hi", max_tokens=1)
    assert r.status_code == 429, r.text  # the aborted streams' tokens are in the window
    assert 1 <= int(r.headers["retry-after"]) <= 60
    # The gateway is fine, and another key has its own budget.
    other = create_key(gw.url, name="tpm-burst-other", tpm=30)["key"]
    r = await asyncio.to_thread(_chat, gw.url, other, "hi", max_tokens=2)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "echo: hi"


async def test_finished_requests_free_their_hold_for_the_real_usage(gw):
    # A hold is an upper bound: once a request finishes, only what it used stays in the window, so
    # sequential small requests go on being admitted where a hold each would have run out.
    created = create_key(gw.url, name="tpm-settle", tpm=60)
    hold = _estimate("hi", 20)
    assert 3 * hold > 60  # were holds never settled, the third request would be refused
    used = 0
    for _ in range(4):
        r = await asyncio.to_thread(_chat, gw.url, created["key"], "hi", max_tokens=20)
        assert r.status_code == 200, r.text
        used += r.json()["usage"]["total_tokens"]
    assert used < hold and _window(gw, created["id"]) == (0, used)


async def test_a_request_bigger_than_the_whole_tpm_waits_for_an_idle_window(gw):
    # Its estimate alone is over tpm: it holds the whole budget rather than being refused forever.
    key = create_key(gw.url, name="tpm-small", tpm=10)["key"]
    assert _estimate("hello there", 500) > 10
    r = await asyncio.to_thread(_chat, gw.url, key, "hello there", max_tokens=500)
    assert r.status_code == 200, r.text
    r = await asyncio.to_thread(_chat, gw.url, key, "hello there", max_tokens=500)
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"


# ---- the limiters, directly -------------------------------------------------------------------


def _hold(tokens: int) -> Hold:
    return Hold(uuid.uuid4().hex, tokens)


async def test_local_holds_bound_concurrent_admissions():
    limiter = LocalLimiter()
    holds = [_hold(10) for _ in range(20)]
    results = await asyncio.gather(*(limiter.admit("k", None, 30, h) for h in holds))
    admitted = [h for h, r in zip(holds, results) if r is None]
    assert len(admitted) == 3
    assert all(r is not None and r > 0 for r in results if r is not None)
    await limiter.settle("k", admitted[0], 2)  # 2 used + 20 held: one more 8-token request fits
    assert await limiter.admit("k", None, 30, _hold(8)) is None
    assert await limiter.admit("k", None, 30, _hold(1)) is not None


async def test_abandoned_reservations_charge_only_after_output_began():
    limiter = LocalLimiter()
    before = Reservation(limiter, "k", _hold(30), prompt_tokens=5)
    assert await limiter.admit("k", None, 30, before.hold) is None
    await before.abandon(output_bytes=0)  # failed before any output: nothing charged
    after = Reservation(limiter, "k", _hold(30), prompt_tokens=5)
    assert await limiter.admit("k", None, 30, after.hold) is None
    await after.abandon(output_bytes=4)  # cut off after its first token: the whole hold
    await after.settle(1)  # settles once: a late settle changes nothing
    assert await limiter.admit("k", None, 30, _hold(1)) is not None


@pytest.fixture
async def replicas():
    if not redis_available():
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    prefix = f"fs-test-{uuid.uuid4().hex[:8]}:"
    # two live replicas, and a third whose holds live 1 s (a replica that died holding them):
    # live ones keep their holds however slowly a loaded machine runs the test
    limiters = [
        RedisLimiter(REDIS_URL, prefix),
        RedisLimiter(REDIS_URL, prefix),
        RedisLimiter(REDIS_URL, prefix, hold_ttl=1.0),
    ]
    yield limiters
    keys = await limiters[0].redis.keys(prefix + "*")
    if keys:
        await limiters[0].redis.delete(*keys)
    for limiter in limiters:
        await limiter.aclose()


@pytest.mark.redis
async def test_redis_holds_bound_admissions_across_replicas(replicas):
    a, b, _ = replicas
    holds = [_hold(10) for _ in range(20)]
    results = await asyncio.gather(
        *(replicas[i % 2].admit("key_c", None, 30, h) for i, h in enumerate(holds))
    )
    admitted = [h for h, r in zip(holds, results) if r is None]
    assert len(admitted) == 3
    # A hold taken through one replica is settled through the other.
    await b.settle("key_c", admitted[0], 2)
    assert await a.admit("key_c", None, 30, _hold(8)) is None
    assert await a.admit("key_c", None, 30, _hold(1)) is not None


@pytest.mark.redis
async def test_redis_holds_of_a_dead_replica_expire(replicas):
    _, _, dying = replicas  # its holds live 1 s: as if it had died holding them
    assert await dying.admit("key_d", None, 30, _hold(30)) is None
    assert await dying.admit("key_d", None, 30, _hold(1)) is not None
    await asyncio.sleep(1.2)
    assert await dying.admit("key_d", None, 30, _hold(30)) is None


@pytest.mark.redis
async def test_concurrent_streams_across_two_gateways_sharing_redis(upstreams, tmp_path):
    if not redis_available():
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    store = ScratchStore("sqlite", tmp_path)
    config = gateway_config(upstreams, store, tmp_path / "state", redis_url=REDIS_URL)
    gateways = [start_gateway(config), start_gateway(config)]  # same database, same Redis prefix
    try:
        key = create_key(gateways[0].url, name="tpm-replicas", tpm=30)["key"]
        marker = uuid.uuid4().hex[:4]
        since = len(upstreams["openai"].requests)
        text, max_tokens = f"[[slow:0.2]] {marker}", 1
        fit = 30 // _estimate(text, max_tokens)
        opened = await asyncio.gather(
            *(_open_streams(g.url, key, text, 10, max_tokens) for g in gateways)
        )
        try:
            assert sum(len(admitted) for _, admitted, _ in opened) == fit
            assert all(r.status_code == 429 for _, _, refused in opened for r in refused)
            calls = _upstream_calls(upstreams, marker, since)
            assert len(calls) == fit, _described(calls)
            await asyncio.gather(*(_first_token_then_abort(admitted) for _, admitted, _ in opened))
        finally:
            for client, _, _ in opened:
                await client.aclose()
        await _until_upstream_cancelled(upstreams, marker, fit, since)
        for g in gateways:  # charged on both replicas' shared window
            assert (
                await asyncio.to_thread(_chat, g.url, key, "hi", max_tokens=1)
            ).status_code == 429
        assert (await asyncio.to_thread(_chat, gateways[1].url, MASTER_KEY)).status_code == 200
    finally:
        for g in gateways:
            g.stop()


async def test_a_reply_without_usage_is_charged_its_estimate():
    # An upstream that reports no usage does not make its tokens free.
    limiter = LocalLimiter()
    reservation = Reservation(limiter, "k", _hold(25), prompt_tokens=5)
    assert await limiter.admit("k", None, 30, reservation.hold) is None
    await reservation.finish(Usage(), output_bytes=72)  # 5 + 72 / 3.6 = 25 tokens
    assert limiter.state("k") == (0, 25)
    assert await limiter.admit("k", None, 30, _hold(6)) is not None
    assert await limiter.admit("k", None, 30, _hold(5)) is None


@pytest.mark.redis
async def test_redis_totals_survive_an_evicted_key(replicas):
    # The running totals are a cache of the sets: a lost total is recounted, a lost set zeroes it.
    a, _, _ = replicas
    held = _hold(10)
    assert await a.admit("key_e", None, 30, held) is None
    done = _hold(10)
    assert await a.admit("key_e", None, 30, done) is None
    await a.settle("key_e", done, 15)  # 10 held + 15 used
    _, used, _, totals = a._keys("key_e")
    await a.redis.delete(totals)
    assert await a.admit("key_e", None, 30, _hold(6)) is not None  # recounted: 25 + 6 > 30
    assert await a.admit("key_e", None, 30, _hold(5)) is None  # 25 + 5 fits
    await a.redis.delete(used)  # the window's entries lost: the 15 held remain
    assert await a.admit("key_e", None, 30, _hold(15)) is None
    assert await a.admit("key_e", None, 30, _hold(1)) is not None
