"""Upstream client CPU per request, httpx vs aiohttp: docs/benchmarks.md, "Upstream client"."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent


def body(stream: bool) -> bytes:
    return orjson.dumps(
        {
            "model": "gpt-4o-mini",
            "max_tokens": 64,
            "stream": stream,
            "messages": [{"role": "user", "content": "Say hello in twenty words."}],
        }
    )


HEADERS = {"content-type": "application/json", "authorization": "Bearer sk-mock"}


async def with_httpx(url: str, n: int, stream: bool) -> None:
    import httpx

    content = body(stream)
    async with httpx.AsyncClient(
        http2=True, limits=httpx.Limits(max_keepalive_connections=200)
    ) as c:
        for _ in range(n):
            if stream:
                async with c.stream("POST", url, content=content, headers=HEADERS) as r:
                    async for _line in r.aiter_lines():
                        pass
            else:
                r = await c.post(url, content=content, headers=HEADERS)
                orjson.loads(r.content)


async def with_aiohttp(url: str, n: int, stream: bool) -> None:
    import aiohttp

    content = body(stream)
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        for _ in range(n):
            async with s.post(url, data=content, headers=HEADERS) as r:
                if stream:
                    async for _line in r.content:
                        pass
                else:
                    orjson.loads(await r.read())


def measure(fn, url: str, n: int, stream: bool) -> dict:
    import uvloop

    uvloop.run(fn(url, n // 10, stream))  # warm-up
    cpu0, t0 = time.process_time(), time.perf_counter()
    uvloop.run(fn(url, n, stream))
    return {
        "cpu_us_per_request": round((time.process_time() - cpu0) / n * 1e6, 1),
        "wall_us_per_request": round((time.perf_counter() - t0) / n * 1e6, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=5000)
    args = p.parse_args()
    port = 9300 + os.getpid() % 500
    mock = subprocess.Popen(
        ["taskset", "-c", "1", sys.executable, str(HERE / "mock_upstream.py"), "--port", str(port)],
        stdout=subprocess.DEVNULL,
    )
    os.sched_setaffinity(0, {0})
    try:
        time.sleep(1.0)
        out = {}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        for stream in (False, True):
            for name, fn in (("httpx", with_httpx), ("aiohttp", with_aiohttp)):
                out[f"{name}_{'stream' if stream else 'nonstream'}"] = measure(
                    fn, url, args.n, stream
                )
        print(json.dumps(out, indent=2))
    finally:
        mock.terminate()


if __name__ == "__main__":
    main()
