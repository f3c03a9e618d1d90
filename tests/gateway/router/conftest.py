"""Gateways with the real router in front of fault-injecting upstreams (see faulty.py)."""

from __future__ import annotations

import uuid
from contextlib import contextmanager

import anthropic
import httpx
import openai
import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig, RouterConfig
from tests.fakes.server import FakeServer
from tests.gateway.router.faulty import FaultyUpstream

# Fast defaults for tests: short backoff and cooldown, no background probes unless a test asks.
FAST = dict(
    retry_backoff=0.01,
    retry_backoff_max=0.05,
    breaker_cooldown=0.5,
    health_check_interval=0,
    ttft_timeout=5.0,
)


@pytest.fixture
def ups():
    """Three healthy fault-injecting upstreams: a, b, c."""
    servers = {n: FaultyUpstream(n).start() for n in "abc"}
    yield servers
    for s in servers.values():
        s.stop()


def deployment(name: str, up: FaultyUpstream, **extra) -> ModelConfig:
    return ModelConfig(
        name=name,
        provider="openai",
        model="m",
        api_base=up.url,
        api_key="k",
        **{"timeout": 10.0, "connect_timeout": 2.0, **extra},
    )


@contextmanager
def gateway(models: list[ModelConfig], **router):
    """A real gateway (uvicorn in a thread) with `models` and RouterConfig(FAST | router)."""
    # Compression off: a prompt over a window must reach the router (context_window_fallbacks).
    cfg = Config(
        models=models, router=RouterConfig(**{**FAST, **router}), compression={"mode": "off"}
    )
    # as `flashstack serve` runs
    with FakeServer(create_app(cfg), lifespan="on", loop="uvloop") as gw:
        yield gw


def openai_client(gw, timeout: float = 20) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=timeout)


def anthropic_client(gw, timeout: float = 20) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0, timeout=timeout)


def new_tag() -> str:
    return "t" + uuid.uuid4().hex[:12]


def ask(client: openai.OpenAI, model: str, tag: str, stream: bool = False):
    """(text, headers) of one chat completion whose prompt carries `#tag`."""
    messages = [{"role": "user", "content": f"hello #{tag}"}]
    if not stream:
        raw = client.chat.completions.with_raw_response.create(model=model, messages=messages)
        return raw.parse().choices[0].message.content, raw.headers
    with client.chat.completions.with_streaming_response.create(
        model=model, messages=messages, stream=True
    ) as r:
        text = "".join(c.choices[0].delta.content or "" for c in r.parse() if c.choices)
        return text, r.headers


def readiness(gw) -> dict:
    return httpx.get(gw.url + "/health/readiness", timeout=10).json()


def breaker_of(gw, dep_id: str) -> dict:
    for deps in readiness(gw)["models"].values():
        for d in deps:
            if d["deployment"] == dep_id:
                return d
    raise KeyError(dep_id)
