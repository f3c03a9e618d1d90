"""A verified client certificate can stand in for an API key (auth.client_cert_keys)."""

from __future__ import annotations

import asyncio
import types

import httpx
import pytest

from flashstack.gateway.auth import KeyStore
from flashstack.gateway.config import (
    AuthConfig,
    Config,
    ModelConfig,
    ServerConfig,
    StoreConfig,
    TLSConfig,
)
from flashstack.gateway.sessions.db import Database, migrate
from flashstack.gateway.tls import ServerTLS
from tests.fakes.server import FakeServer
from tests.gateway.conftest import API_KEY
from tests.gateway.tls.certs import client_context
from tests.gateway.tls.conftest import CLIENT_NAME, PKI, tls_app

MASTER = "master-secret"


async def _create_key(config: Config, name: str, models: list[str] | None) -> str:
    db = await Database.from_config(config).open()
    try:
        await migrate(db)
        return (await KeyStore(db).create(name, models))["id"]
    finally:
        await db.close()


@pytest.fixture(scope="module")
def cert_gateway(pki: PKI, openai_upstream, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    models = [
        ModelConfig(
            name="gpt",
            provider="openai",
            model="gpt-4o-mini",
            api_base=openai_upstream.url + "/v1",
            api_key=API_KEY,
        )
    ]
    config = Config(
        server=ServerConfig(),
        models=models,
        state_dir=state,
        store=StoreConfig(database_url=f"sqlite+aiosqlite:///{state}/gw.db"),
    )
    key_id = asyncio.run(_create_key(config, "svc-a", ["gpt"]))
    config.auth = AuthConfig(
        master_key=MASTER, client_cert_keys={CLIENT_NAME: key_id, "svc-*.test": "key_missing"}
    )
    tls = ServerTLS.from_config(
        TLSConfig(
            cert_file=pki.server.cert_file,
            key_file=pki.server.key_file,
            client_ca_file=pki.ca.cert_file,
            client_auth="optional",
        )
    )
    app = tls_app(config, tls)
    server = FakeServer(app, lifespan="on", loop="uvloop", **tls.uvicorn_options("httptools"))
    tls.start()
    server.start()
    yield types.SimpleNamespace(url=f"https://127.0.0.1:{server.port}", key_id=key_id)
    server.stop()
    tls.close()


def _chat(gw, ctx, headers=None) -> httpx.Response:
    with httpx.Client(verify=ctx, timeout=10) as client:
        body = {"model": "gpt", "messages": [{"role": "user", "content": "hi"}]}
        return client.post(gw.url + "/v1/chat/completions", json=body, headers=headers or {})


def test_mapped_client_certificate_is_its_key(cert_gateway, pki):
    r = _chat(cert_gateway, client_context(pki.ca.cert_file, pki.client))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "echo: hi"


def test_without_certificate_or_key_is_401(cert_gateway, pki):
    r = _chat(cert_gateway, client_context(pki.ca.cert_file))
    assert r.status_code == 401 and "no API key" in r.json()["error"]["message"]


def test_explicit_key_wins_over_the_certificate(cert_gateway, pki):
    r = _chat(
        cert_gateway,
        client_context(pki.ca.cert_file, pki.client),
        {"authorization": "Bearer fsk_wrong"},
    )
    assert r.status_code == 401 and "invalid API key" in r.json()["error"]["message"]


def test_certificate_mapped_to_a_missing_key_is_401(cert_gateway, pki, tmp_path):
    from tests.gateway.tls.certs import issue

    svc = issue(pki.ca, "svc-b.test", dns=("svc-b.test",), client=True).write(tmp_path, "svc-b")
    r = _chat(cert_gateway, client_context(pki.ca.cert_file, svc))
    assert r.status_code == 401 and "key_missing" in r.json()["error"]["message"]
