"""orjson vs json on the gateway's payloads: docs/benchmarks.md, "JSON library"."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import orjson

REQUEST = {
    "model": "gpt-4o-mini",
    "max_tokens": 256,
    "temperature": 0.7,
    "stream": True,
    "messages": [{"role": "system", "content": "You are a careful assistant. " * 20}]
    + [
        {"role": r, "content": f"turn {i}: " + "some words of conversation " * 15}
        for i, r in enumerate(["user", "assistant", "user", "assistant", "user"])
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look a thing up",
                "parameters": {
                    "type": "object",
                    "properties": {"q": {"type": "string"}},
                    "required": ["q"],
                },
            },
        }
    ],
}
COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1795985785,
    "model": "gpt-4o-mini",
    "choices": [
        {
            "index": 0,
            "finish_reason": "stop",
            "logprobs": None,
            "message": {"role": "assistant", "content": "Hello there, here is an answer. " * 8},
        }
    ],
    "usage": {"prompt_tokens": 412, "completion_tokens": 64, "total_tokens": 476},
}
CHUNK = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 1795985785,
    "model": "gpt-4o-mini",
    "choices": [{"index": 0, "delta": {"content": " word"}, "finish_reason": None}],
}


def per_call_us(fn: Callable[[], object], n: int) -> float:
    for _ in range(n // 10):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=20000)
    n = ap.parse_args().n
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {0})
    out: dict[str, dict[str, float]] = {}
    for name, payload in (
        ("request", REQUEST),
        ("completion", COMPLETION),
        ("stream_chunk", CHUNK),
    ):
        raw = orjson.dumps(payload)
        out[name] = {
            "bytes": len(raw),
            "orjson_loads_us": per_call_us(lambda: orjson.loads(raw), n),
            "json_loads_us": per_call_us(lambda: json.loads(raw), n),
            "orjson_dumps_us": per_call_us(lambda: orjson.dumps(payload), n),
            # What a stdlib-based gateway writes: compact separators, encoded to bytes.
            "json_dumps_us": per_call_us(
                lambda: json.dumps(payload, separators=(",", ":")).encode(), n
            ),
        }
        r = out[name]
        r["loads_ratio"] = r["json_loads_us"] / r["orjson_loads_us"]
        r["dumps_ratio"] = r["json_dumps_us"] / r["orjson_dumps_us"]
        out[name] = {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
