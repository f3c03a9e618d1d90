"""Two gateway processes on one PostgreSQL and one Redis: one session store, one set of limits."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from tests.gateway.sessions.support import (
    MASTER_KEY,
    REDIS_URL,
    GatewayProcess,
    ScratchStore,
    auth_headers,
    create_key,
    gateway_config,
    pg_available,
    redis_available,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def replicas(upstreams, tmp_path_factory):
    if not (pg_available() and redis_available()):
        pytest.skip("needs PostgreSQL on 127.0.0.1:5432 and Redis on 127.0.0.1:6379")
    tmp = tmp_path_factory.mktemp("replicas")
    store = ScratchStore("postgres", tmp)
    config = gateway_config(upstreams, store, tmp, redis_url=REDIS_URL)
    # Started together: both migrate the fresh schema at once, which must be safe.
    first, second = GatewayProcess(config, tmp).launch(), GatewayProcess(config, tmp).launch()
    first.wait_ready(), second.wait_ready()
    yield first, second
    for g in (first, second):
        g.stop()
    store.drop()


def _post_turn(url: str, key: str, sid: str, text: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/sessions/{sid}/messages",
        json={"content": text},
        headers=auth_headers(key),
        timeout=60,
    )


def _messages(url: str, key: str, sid: str) -> list[dict]:
    r = httpx.get(
        f"{url}/v1/sessions/{sid}/messages", params={"limit": 100}, headers=auth_headers(key)
    )
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_session_written_through_one_is_read_through_the_other(replicas):
    a, b = replicas
    key = create_key(a.url, name="replica-reader")["key"]
    sid = httpx.post(
        a.url + "/v1/sessions", json={"model": "gpt"}, headers=auth_headers(key)
    ).json()["id"]
    assert _post_turn(a.url, key, sid, "written on a").status_code == 200
    assert httpx.get(f"{b.url}/v1/sessions/{sid}", headers=auth_headers(key)).status_code == 200
    assert _post_turn(b.url, key, sid, "written on b").status_code == 200
    texts = [m["content"][0]["text"] for m in _messages(a.url, key, sid)]
    assert texts == ["written on a", "echo: written on a", "written on b", "echo: written on b"]
    # A key made on one replica works on the other, and so does its revocation.
    other = create_key(b.url, name="made-on-b")
    assert httpx.get(f"{a.url}/v1/sessions", headers=auth_headers(other["key"])).status_code == 200
    httpx.delete(f"{a.url}/v1/keys/{other['id']}", headers=auth_headers(MASTER_KEY))
    assert httpx.get(f"{b.url}/v1/sessions", headers=auth_headers(other["key"])).status_code == 401


def test_rate_limit_holds_across_replicas(replicas):
    key = create_key(replicas[0].url, name="shared-100rpm", rpm=100)["key"]
    body = {"model": "gpt", "messages": [{"role": "user", "content": "count me"}]}

    async def main() -> list[int]:
        async with httpx.AsyncClient(
            headers=auth_headers(key), timeout=60, limits=httpx.Limits(max_connections=40)
        ) as c:
            calls = [
                c.post(replicas[i % 2].url + "/v1/chat/completions", json=body) for i in range(130)
            ]
            responses = await asyncio.gather(*calls)
        assert all("retry-after" in r.headers for r in responses if r.status_code == 429)
        return [r.status_code for r in responses]

    statuses = asyncio.run(main())
    assert statuses.count(200) == 100, statuses
    assert statuses.count(429) == 30


def test_concurrent_appends_through_both_replicas_stay_whole_and_ordered(replicas, upstreams):
    a, b = replicas
    key = create_key(a.url, name="appender")["key"]
    sid = httpx.post(
        a.url + "/v1/sessions", json={"model": "gpt"}, headers=auth_headers(key)
    ).json()["id"]
    marker, n = uuid.uuid4().hex[:8], 20

    async def main() -> list[int]:
        async with httpx.AsyncClient(headers=auth_headers(key), timeout=120) as c:
            calls = [
                c.post(
                    f"{replicas[i % 2].url}/v1/sessions/{sid}/messages",
                    json={"content": f"a{i} {marker}", "stream": i % 3 == 0},
                )
                for i in range(n)
            ]
            return [r.status_code for r in await asyncio.gather(*calls)]

    assert asyncio.run(main()) == [200] * n
    items = _messages(b.url, key, sid)
    assert len(items) == 2 * n
    users = set()
    for user, reply in zip(items[::2], items[1::2]):
        assert (user["role"], reply["role"]) == ("user", "assistant")
        assert (
            user["turn_id"] == reply["turn_id"] and user["status"] == reply["status"] == "completed"
        )
        assert reply["content"][0]["text"] == "echo: " + user["content"][0]["text"]
        users.add(user["content"][0]["text"])
    assert users == {f"a{i} {marker}" for i in range(n)}
    # Serialized: each turn's model call saw every earlier turn of the session.
    sizes = sorted(
        len(r.body["messages"])
        for r in upstreams["openai"].requests
        if r.body and marker in str(r.body["messages"][-1])
    )
    assert sizes == [2 * i + 1 for i in range(n)]
