"""A gateway (auth on, SQLite store) in front of the recording OpenAI-compatible and Anthropic
fakes, and the official `openai` SDK pointed at it with two keys of its own."""

from __future__ import annotations

import httpx
import openai
import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.config import AuthConfig, Config, ModelConfig
from tests.fakes import anthropic_upstream, openai_upstream
from tests.fakes.server import FakeServer
from tests.gateway.protocol.conftest import ROUTING

MASTER = "sk-master-responses"
UPSTREAM_KEY = "sk-upstream"


@pytest.fixture(scope="session")
def fakes():
    servers = {
        "openai": FakeServer(openai_upstream.create_app()).start(),
        "anthropic": FakeServer(anthropic_upstream.create_app()).start(),
    }
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="session")
def gateway(fakes, tmp_path_factory):
    config = Config(
        state_dir=tmp_path_factory.mktemp("responses-state"),
        router=ROUTING,
        auth=AuthConfig(master_key=MASTER),
        models=[
            ModelConfig(
                name="oai",
                provider="openai",
                model="gpt-4o-mini",
                api_base=fakes["openai"].url + "/v1",
                api_key=UPSTREAM_KEY,
            ),
            ModelConfig(
                name="claude",
                provider="anthropic",
                model="claude-sonnet-4-5",
                api_base=fakes["anthropic"].url,
                api_key=UPSTREAM_KEY,
            ),
        ],
    )
    server = FakeServer(create_app(config), lifespan="on").start()
    yield server
    server.stop()


@pytest.fixture
def upstream(fakes):
    for s in fakes.values():
        s.requests.clear()
    return fakes


def _key(url: str, name: str) -> str:
    r = httpx.post(
        url + "/v1/keys", json={"name": name}, headers={"authorization": f"Bearer {MASTER}"}
    )
    assert r.status_code == 200, r.text
    return r.json()["key"]


@pytest.fixture(scope="session")
def keys(gateway):
    return _key(gateway.url, "alice"), _key(gateway.url, "bob")


@pytest.fixture(scope="session")
def client(gateway, keys):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=keys[0], max_retries=0, timeout=20)


@pytest.fixture(scope="session")
def other_client(gateway, keys):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=keys[1], max_retries=0, timeout=20)
