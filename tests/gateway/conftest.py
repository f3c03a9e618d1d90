"""A real gateway (uvicorn, in a thread) in front of the three faithful fake upstreams."""

from __future__ import annotations

import anthropic
import openai
import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig, RouterConfig, ServerConfig
from flashstack.gateway.server_limits import uvicorn_options
from tests.fakes import anthropic_upstream, ollama_upstream, openai_upstream
from tests.fakes.server import FakeServer

API_KEY = "sk-test-upstream"
# The fakes fail per prompt ([[status:500]]), not per deployment: no waiting between attempts and
# breakers that never trip keep these tests independent. tests/gateway/router/ tests
# the router itself.
DIRECT_ROUTING = RouterConfig(
    num_retries=1,
    retry_backoff=0,
    max_retry_after=0,
    breaker_failures=10**6,
    breaker_min_requests=10**6,
    health_check_interval=0,
)


@pytest.fixture(scope="session")
def upstreams():
    servers = {
        "anthropic": FakeServer(anthropic_upstream.create_app(api_key=API_KEY)).start(),
        "openai": FakeServer(openai_upstream.create_app(api_key=API_KEY)).start(),
        "ollama": FakeServer(ollama_upstream.create_app()).start(),
    }
    yield servers
    for s in servers.values():
        s.stop()


def gateway_config(upstreams, **server) -> Config:
    return Config(
        server=ServerConfig(**server),
        router=DIRECT_ROUTING,
        models=[
            ModelConfig(
                name="claude",
                provider="anthropic",
                model="claude-sonnet-4-5",
                api_base=upstreams["anthropic"].url,
                api_key=API_KEY,
            ),
            ModelConfig(
                name="gpt",
                provider="openai",
                model="gpt-4o-mini",
                api_base=upstreams["openai"].url + "/v1",
                api_key=API_KEY,
            ),
            ModelConfig(
                name="llama", provider="ollama", model="llama3.2", api_base=upstreams["ollama"].url
            ),
            ModelConfig(
                name="textonly",
                provider="openai",
                model="gpt-4o-mini",
                supports_images=False,
                api_base=upstreams["openai"].url + "/v1",
                api_key=API_KEY,
            ),
        ],
    )


@pytest.fixture(scope="session")
def gateway(upstreams):
    config = gateway_config(upstreams, max_body_bytes=1024 * 1024)
    # The server limits `flashstack serve` runs with (its protocol class, timeouts).
    server = FakeServer(
        create_app(config), lifespan="on", loop="uvloop", **uvicorn_options(config.server)
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def openai_client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.fixture(scope="session")
def anthropic_client(gateway):
    return anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=20)
