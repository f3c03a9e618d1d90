"""Two gateways sharing Redis see one breaker state and one in-flight count per deployment."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from tests.gateway.router.conftest import (
    ask,
    breaker_of,
    deployment,
    gateway,
    new_tag,
    openai_client,
)

pytestmark = pytest.mark.redis
REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def prefix():
    p = f"test:router:{uuid.uuid4().hex}:"
    yield p
    r = redis.Redis.from_url(REDIS_URL)
    keys = list(r.scan_iter(match=p + "*"))
    if keys:
        r.delete(*keys)
    r.close()


def models(ups):
    return [deployment("primary", ups["a"], fallbacks=["backup"]), deployment("backup", ups["b"])]


def test_a_breaker_opened_by_one_gateway_is_open_in_the_other(ups, prefix):
    shared = dict(
        redis_url=REDIS_URL,
        redis_prefix=prefix,
        num_retries=0,
        breaker_failures=2,
        breaker_cooldown=30,
    )
    ups["a"].fail("status", status=503)
    with gateway(models(ups), **shared) as gw1, gateway(models(ups), **shared) as gw2:
        assert breaker_of(gw2, "primary#0")["breaker"] == "closed"
        for _ in range(2):
            ask(openai_client(gw1), "primary", new_tag())
        seen_by_2 = breaker_of(gw2, "primary#0")
        assert seen_by_2["breaker"] == "open" and seen_by_2["cooldown_s"] > 25
        tag = new_tag()
        text, headers = ask(openai_client(gw2), "primary", tag)
        assert text.startswith("b:") and headers["x-flashstack-attempts"] == "1"
        assert tag not in ups["a"].tags(), "gateway 2 never sent it to the open deployment"
        metrics = httpx.get(gw2.url + "/metrics").text
        assert 'flashstack_breaker_state{deployment="primary#0"} 2.0' in metrics


def test_in_flight_is_counted_across_gateways(ups, prefix):
    ups["a"].chunks, ups["a"].interval = 20, 0.05
    shared = dict(redis_url=REDIS_URL, redis_prefix=prefix)
    with gateway(models(ups), **shared) as gw1, gateway(models(ups), **shared) as gw2:
        done = threading.Event()

        def slow_stream():
            ask(openai_client(gw1), "primary", new_tag(), stream=True)
            done.set()

        t = threading.Thread(target=slow_stream)
        t.start()
        deadline = time.monotonic() + 5
        while breaker_of(gw2, "primary#0")["in_flight"] != 1:
            assert time.monotonic() < deadline, "gateway 2 never saw gateway 1's stream"
            time.sleep(0.05)
        t.join(10)
        assert done.is_set()
        assert breaker_of(gw2, "primary#0")["in_flight"] == 0


@pytest.mark.slow
def test_two_gateway_processes_share_breaker_state(ups, prefix, tmp_path: Path):
    """The same, with two real `flashstack serve` processes."""
    ups["a"].fail("status", status=503)
    config = {
        "models": [m.model_dump(exclude_none=True) for m in models(ups)],
        "router": {
            "redis_url": REDIS_URL,
            "redis_prefix": prefix,
            "num_retries": 0,
            "breaker_failures": 2,
            "breaker_cooldown": 30,
            "health_check_interval": 0,
        },
    }
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(config))
    ports = [_free_port(), _free_port()]
    with ExitStack() as stack:
        for port in ports:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from flashstack.cli import main; main()",
                    "serve",
                    "--config",
                    str(path),
                    "--port",
                    str(port),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            stack.callback(_stop, proc)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url in urls:
            _wait_up(url)
        gw1, gw2 = (type("GW", (), {"url": u})() for u in urls)
        for _ in range(2):
            ask(openai_client(gw1), "primary", new_tag())
        assert breaker_of(gw2, "primary#0")["breaker"] == "open"
        tag = new_tag()
        assert ask(openai_client(gw2), "primary", tag)[0].startswith("b:")
        assert tag not in ups["a"].tags()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health/liveness", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"gateway at {url} did not start")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
