"""Sessions, keys and limits, cost per request: docs/benchmarks.md, "Sessions, keys and limits"."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.fakes import anthropic_upstream, openai_upstream  # noqa: E402
from tests.fakes.server import FakeServer  # noqa: E402
from tests.gateway.conftest import API_KEY  # noqa: E402
from tests.gateway.sessions.support import (  # noqa: E402
    REDIS_URL,
    ScratchStore,
    auth_headers,
    create_key,
    gateway_config,
    pg_available,
    redis_available,
    start_gateway,
)


async def _load(
    url: str, headers: dict[str, str], bodies: list[tuple[str, dict]], concurrency: int
) -> dict[str, Any]:
    latencies: list[float] = []
    queue: asyncio.Queue[tuple[str, dict]] = asyncio.Queue()
    for item in bodies:
        queue.put_nowait(item)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            path, body = queue.get_nowait()
            t = time.perf_counter()
            r = await client.post(path, json=body)
            latencies.append((time.perf_counter() - t) * 1000)
            assert r.status_code == 200, r.text

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        await client.post(bodies[0][0], json=bodies[0][1])  # warm the connection and code paths
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "p50_ms": round(statistics.median(latencies), 2),
        "p99_ms": round(latencies[int(len(latencies) * 0.99) - 1], 2),
        "rps": round(len(latencies) / elapsed, 1),
    }


def _chat(n: int) -> list[tuple[str, dict]]:
    return [
        (
            "/v1/chat/completions",
            {"model": "gpt", "messages": [{"role": "user", "content": f"hi {i}"}]},
        )
        for i in range(n)
    ]


def _turns(url: str, key: str, sessions: int, n: int) -> list[tuple[str, dict]]:
    sids = [
        httpx.post(url + "/v1/sessions", json={"model": "gpt"}, headers=auth_headers(key)).json()[
            "id"
        ]
        for _ in range(sessions)
    ]
    return [
        (f"/v1/sessions/{sids[i % sessions]}/messages", {"content": f"turn {i}"}) for i in range(n)
    ]


def bench_store(kind: str, upstreams: dict, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    store = ScratchStore(kind, tmp)
    out: dict[str, Any] = {}
    try:
        off = start_gateway(gateway_config(upstreams, store, tmp, master_key=None))
        out["chat_auth_off"] = asyncio.run(
            _load(off.url, {}, _chat(args.requests), args.concurrency)
        )
        off.stop()
        gw = start_gateway(gateway_config(upstreams, store, tmp))
        key = create_key(gw.url, name="bench")["key"]
        limited = create_key(gw.url, name="bench-rpm", rpm=10**9)["key"]
        out["chat_with_key"] = asyncio.run(
            _load(gw.url, auth_headers(key), _chat(args.requests), args.concurrency)
        )
        out["chat_with_key_rpm_local"] = asyncio.run(
            _load(gw.url, auth_headers(limited), _chat(args.requests), args.concurrency)
        )
        turns = _turns(gw.url, key, args.concurrency, args.requests)
        out["session_turn_many_sessions"] = asyncio.run(
            _load(gw.url, auth_headers(key), turns, args.concurrency)
        )
        one = _turns(gw.url, key, 1, args.requests // 2)
        out["session_turn_one_session"] = asyncio.run(
            _load(gw.url, auth_headers(key), one, args.concurrency)
        )
        gw.stop()
        if redis_available():
            gw = start_gateway(gateway_config(upstreams, store, tmp, redis_url=REDIS_URL))
            out["chat_with_key_rpm_redis"] = asyncio.run(
                _load(gw.url, auth_headers(limited), _chat(args.requests), args.concurrency)
            )
            gw.stop()
    finally:
        store.drop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()
    upstreams = {
        "openai": FakeServer(openai_upstream.create_app(api_key=API_KEY)).start(),
        "anthropic": FakeServer(anthropic_upstream.create_app(api_key=API_KEY)).start(),
    }
    results: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "requests": args.requests,
        "concurrency": args.concurrency,
    }
    kinds = ["sqlite"] + (["postgres"] if pg_available() else [])
    for kind in kinds:
        with tempfile.TemporaryDirectory() as tmp:
            results[kind] = bench_store(kind, upstreams, args, Path(tmp))
    print(json.dumps(results, indent=2))
    for s in upstreams.values():
        s.stop()


if __name__ == "__main__":
    main()
