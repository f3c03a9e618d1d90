"""A gateway in front of two canned recording upstreams (one per wire), and the official SDKs
pointed at the gateway and straight at the upstreams, to compare what each side sees."""

from __future__ import annotations

import anthropic
import openai
import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig, RouterConfig, StoreConfig
from tests.fakes.server import FakeServer
from tests.gateway.protocol import canned, samples

UPSTREAM_KEY = "sk-upstream-key"
CLIENT_KEY = "sk-client-key-never-forwarded"
ROUTING = RouterConfig(
    num_retries=0,
    retry_backoff=0,
    max_retry_after=0,
    breaker_failures=10**6,
    breaker_min_requests=10**6,
    health_check_interval=0,
)
OPENAI_MODEL, ANTHROPIC_MODEL = "gpt-upstream-1", "claude-upstream-1"


@pytest.fixture(scope="session")
def canned_upstreams():
    servers = {
        "openai": FakeServer(canned.create_app("openai")).start(),
        "anthropic": FakeServer(canned.create_app("anthropic")).start(),
    }
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from flashstack.engine.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-random")


@pytest.fixture(scope="session")
def protocol_gateway(canned_upstreams, tmp_path_factory, tiny_model):
    server = FakeServer(
        create_app(gateway_config(canned_upstreams, tmp_path_factory, tiny_model)), lifespan="on"
    ).start()
    yield server
    server.stop()


def gateway_config(
    canned_upstreams, tmp_path_factory, tiny_model, store: StoreConfig | None = None
) -> Config:
    """The gateway in front of the canned upstreams (its sessions in `store`; default: SQLite in
    its state_dir)."""
    return Config(
        state_dir=tmp_path_factory.mktemp("protocol-state"),
        router=ROUTING,
        store=store or StoreConfig(),
        models=[
            ModelConfig(
                name="oai",
                provider="openai",
                model=OPENAI_MODEL,
                api_base=canned_upstreams["openai"].url + "/v1",
                api_key=UPSTREAM_KEY,
            ),
            ModelConfig(
                name="claude",
                provider="anthropic",
                model=ANTHROPIC_MODEL,
                api_base=canned_upstreams["anthropic"].url,
                api_key=UPSTREAM_KEY,
            ),
            # Never loaded here: count_tokens reads only its tokenizer.
            ModelConfig(
                name="tiny", provider="local", model=str(tiny_model), supports_images=False
            ),
        ],
    )


@pytest.fixture
def upstream(canned_upstreams):
    """The canned upstreams, their recordings cleared and their replies reset for this test."""
    for s in canned_upstreams.values():
        s.requests.clear()
        s.app.state.reply = canned.Reply()
    return canned_upstreams


@pytest.fixture
def answered(upstream):
    """The canned upstreams answering with responses (and streams) that carry every
    documented field."""
    upstream["openai"].app.state.reply = canned.Reply(
        body=samples.openai_response(), events=samples.openai_events()
    )
    upstream["anthropic"].app.state.reply = canned.Reply(
        body=samples.anthropic_response(), events=samples.anthropic_events()
    )
    return upstream


@pytest.fixture(scope="session")
def clients(protocol_gateway, canned_upstreams):
    """{"gateway" | "direct": (OpenAI client, Anthropic client)}."""

    def pair(openai_base: str, anthropic_base: str):
        return (
            openai.OpenAI(base_url=openai_base, api_key=CLIENT_KEY, max_retries=0, timeout=20),
            anthropic.Anthropic(
                base_url=anthropic_base, api_key=CLIENT_KEY, max_retries=0, timeout=20
            ),
        )

    return {
        "gateway": pair(protocol_gateway.url + "/v1", protocol_gateway.url),
        "direct": pair(canned_upstreams["openai"].url + "/v1", canned_upstreams["anthropic"].url),
    }
