"""SIGKILL a gateway in the middle of 50 concurrent session streams, restart it: every session holds
only whole turns, and every turn whose stream the client saw finish is there."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import httpx
import pytest

from tests.gateway.sessions.support import (
    MASTER_KEY,
    GatewayProcess,
    ScratchStore,
    auth_headers,
    gateway_config,
    pg_available,
)

pytestmark = pytest.mark.slow
STREAMS = 50


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request, tmp_path):
    if request.param == "postgres" and not pg_available():
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    s = ScratchStore(request.param, tmp_path)
    yield s
    s.drop()


async def _client_loop(
    url: str, sid: str, i: int, completed: set[tuple[int, int]], started: list[int]
) -> None:
    """Stream turns into one session until the gateway dies; remember those seen to finish."""
    async with httpx.AsyncClient(headers=auth_headers(MASTER_KEY), timeout=60) as c:
        for n in range(10_000):
            # Every fifth session streams slowly, so some streams are always mid-way at the kill.
            text = f"s{i} t{n}" + (" [[slow:0.05]]" if i % 5 == 0 else "")
            try:
                async with c.stream(
                    "POST",
                    f"{url}/v1/sessions/{sid}/messages",
                    json={"content": text, "stream": True},
                ) as r:
                    started[i] += 1
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]" and r.status_code == 200:
                            completed.add((i, n))  # complete as the client sees it: its last event
            except httpx.HTTPError:
                return  # the gateway is gone


async def _run_until_killed(gw: GatewayProcess, sids: list[str]) -> set[tuple[int, int]]:
    completed: set[tuple[int, int]] = set()
    started = [0] * STREAMS
    tasks = [
        asyncio.create_task(_client_loop(gw.url, sid, i, completed, started))
        for i, sid in enumerate(sids)
    ]
    deadline = time.monotonic() + 30
    while (len(completed) < 2 * STREAMS or min(started) == 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    gw.kill()  # SIGKILL: no shutdown hooks, no flush, connections cut mid-stream
    await asyncio.gather(*tasks)
    return completed


def test_sigkill_mid_stream_leaves_only_whole_turns(upstreams, store, tmp_path):
    config = gateway_config(upstreams, store, tmp_path, lease_ttl=2.0)
    gw = GatewayProcess(config, tmp_path).start()
    try:
        sids = [
            httpx.post(
                gw.url + "/v1/sessions", json={"model": "gpt"}, headers=auth_headers(MASTER_KEY)
            ).json()["id"]
            for _ in range(STREAMS)
        ]
        completed = asyncio.run(_run_until_killed(gw, sids))
        assert len(completed) >= STREAMS  # the kill really came in the middle of a busy run
        gw = GatewayProcess(config, tmp_path, port=gw.port).start()

        rows = store.query(
            "SELECT session_id, seq, turn_id, role, status, content FROM fs_messages ORDER BY "
            "session_id, seq"
        )
        by_session: dict[str, list[tuple]] = defaultdict(list)
        for row in rows:
            by_session[row[0]].append(row)
        stored: set[tuple[int, int]] = set()
        for i, sid in enumerate(sids):
            messages = by_session.get(sid, [])
            assert [m[1] for m in messages] == list(range(len(messages)))  # no gaps, no duplicates
            turns: dict[str, list[tuple]] = defaultdict(list)
            for m in messages:
                turns[m[2]].append(m)
            for turn in turns.values():
                shape = [(m[3], m[4]) for m in turn]
                assert shape in (
                    [("user", "completed"), ("assistant", "completed")],
                    [("user", "incomplete")],
                ), shape
                if shape[0][1] == "completed":
                    user_text = turn[0][5].split('"text":"')[1].split('"')[0]
                    assert f'"echo: {user_text}"' in turn[1][5]
                    n = int(user_text.split()[1][1:])
                    stored.add((i, n))
        missing = completed - stored
        assert not missing, f"turns the client saw complete are gone: {sorted(missing)[:10]}"

        # The restarted gateway serves every session again, including those cut mid-stream
        # (their lock from the dead process expires after store.lease_ttl).
        async def one_more_turn() -> list[int]:
            async with httpx.AsyncClient(headers=auth_headers(MASTER_KEY), timeout=30) as c:
                calls = [
                    c.post(
                        f"{gw.url}/v1/sessions/{sid}/messages", json={"content": "after restart"}
                    )
                    for sid in sids[:10]
                ]
                return [r.status_code for r in await asyncio.gather(*calls)]

        assert asyncio.run(one_more_turn()) == [200] * 10
    finally:
        gw.kill()
