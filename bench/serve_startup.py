"""Seconds from `flashstack serve` to ready and first answer: docs/benchmarks.md, "Start-up"."""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

MODEL = "smollm2-135m-instruct"
QUESTION = {
    "model": MODEL,
    "temperature": 0,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
}
_DISCOVERY_ENV = (
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "OLLAMA_HOST",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_run(cwd: str) -> dict[str, object]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _DISCOVERY_ENV and not k.startswith("FLASHSTACK_")
    }
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashstack.cli", "serve", "--port", str(port)],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("flashstack serve exited")
            try:
                if httpx.get(url + "/health/readiness", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready = time.monotonic() - start
        answer = httpx.post(url + "/v1/chat/completions", json=QUESTION, timeout=300).json()
        first = time.monotonic() - start
        t = time.monotonic()
        httpx.post(url + "/v1/chat/completions", json=QUESTION, timeout=300)
        warm = time.monotonic() - t
    finally:
        proc.terminate()
        proc.wait(10)
    return {
        "ready_s": round(ready, 2),
        "first_answer_s": round(first, 2),
        "warm_answer_s": round(warm, 2),
        "answer": answer["choices"][0]["message"]["content"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cwd:
        runs = [_one_run(cwd) for _ in range(args.runs)]
    summary = {
        k: statistics.median(r[k] for r in runs)
        for k in ("ready_s", "first_answer_s", "warm_answer_s")
    }
    print(
        json.dumps(
            {
                "median": summary,
                "load_average": os.getloadavg(),
                "cpus": os.cpu_count(),
                "runs": runs,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
