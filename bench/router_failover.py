"""Added latency of a failover and a breaker-open skip: docs/benchmarks.md, "Router failover"."""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time

import httpx

from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig, RouterConfig
from tests.fakes import openai_upstream
from tests.fakes.server import FakeServer

NEVER = 10**9


def refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: connecting gets ECONNREFUSED


def models(live: str, dead: str) -> list[ModelConfig]:
    dep = dict(provider="openai", model="gpt-4o-mini", api_key="k")
    return [
        ModelConfig(name="direct", api_base=live, **dep),
        ModelConfig(name="failover", api_base=dead, fallbacks=["direct"], **dep),
    ]


def gateway(live: str, dead: str, **router) -> FakeServer:
    cfg = Config(
        models=models(live, dead),
        compression={"mode": "off"},
        router=RouterConfig(num_retries=0, health_check_interval=0, **router),
    )
    return FakeServer(create_app(cfg), lifespan="on", loop="uvloop").start()


def timed(client: httpx.Client, model: str, stream: bool) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    t0 = time.perf_counter()
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return (time.perf_counter() - t0) * 1000
    ttft = None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if ttft is None and '"content":"' in line.replace(" ", ""):  # the first token
                ttft = (time.perf_counter() - t0) * 1000
    assert ttft is not None
    return ttft


def pct(xs: list[float], q: float) -> float:
    return round(statistics.quantiles(xs, n=100)[q - 1] if q < 100 else max(xs), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()

    upstream = FakeServer(openai_upstream.create_app(api_key="k")).start()
    live, dead = upstream.url + "/v1", f"http://127.0.0.1:{refused_port()}/v1"
    # Gateway 1: breakers never open, so every "failover" request really tries the dead port first.
    # Gateway 2: one failure opens the breaker for an hour, so "failover" becomes a skip.
    gw_try = gateway(live, dead, breaker_failures=NEVER, breaker_min_requests=NEVER)
    gw_skip = gateway(
        live, dead, breaker_failures=1, breaker_cooldown=3600, breaker_max_cooldown=3600
    )
    c_try = httpx.Client(base_url=gw_try.url, timeout=30)
    c_skip = httpx.Client(base_url=gw_skip.url, timeout=30)
    timed(c_skip, "failover", False)  # opens the breaker
    cases = {
        "direct": (c_try, "direct"),
        "failover": (c_try, "failover"),
        "breaker_skip": (c_skip, "failover"),
    }
    samples: dict[str, dict[str, list[float]]] = {
        k: {"complete": [], "stream_ttft": []} for k in cases
    }
    for name, (client, model) in cases.items():  # warm-up
        for _ in range(20):
            timed(client, model, False), timed(client, model, True)
    for _ in range(args.requests):  # interleaved, so drift hits every case alike
        for name, (client, model) in cases.items():
            samples[name]["complete"].append(timed(client, model, False))
            samples[name]["stream_ttft"].append(timed(client, model, True))
    attempts = c_skip.post(
        "/v1/chat/completions",
        json={"model": "failover", "messages": [{"role": "user", "content": "hi"}]},
    ).headers["x-flashstack-attempts"]
    result: dict[str, object] = {
        "requests_per_case": args.requests,
        "python": sys.version.split()[0],
        "breaker_skip_attempts_header": attempts,
    }
    for kind in ("complete", "stream_ttft"):
        base = samples["direct"][kind]
        row = {}
        for name in cases:
            xs = samples[name][kind]
            row[name] = {"p50_ms": pct(xs, 50), "p99_ms": pct(xs, 99)}
            if name != "direct":
                row[name]["added_p50_ms"] = round(pct(xs, 50) - pct(base, 50), 3)
                row[name]["added_p99_ms"] = round(pct(xs, 99) - pct(base, 99), 3)
        result[kind] = row
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    for c in (c_try, c_skip):
        c.close()
    for s in (gw_try, gw_skip, upstream):
        s.stop()


if __name__ == "__main__":
    main()
