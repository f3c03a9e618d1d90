"""Upstream mTLS: the gateway presents a per-model client certificate and verifies a private CA."""

from __future__ import annotations

import ssl
import time

import openai
import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig
from flashstack.gateway.tls import TLSError, upstream_ssl_context
from tests.fakes import openai_upstream
from tests.fakes.server import FakeServer
from tests.gateway.conftest import API_KEY


@pytest.fixture(scope="module")
def mtls_upstream(pki):
    """The fake OpenAI upstream behind HTTPS that demands a client certificate from the test CA."""
    server = FakeServer(
        openai_upstream.create_app(api_key=API_KEY),
        ssl_certfile=str(pki.server.cert_file),
        ssl_keyfile=str(pki.server.key_file),
        ssl_ca_certs=str(pki.ca.cert_file),
        ssl_cert_reqs=ssl.CERT_REQUIRED,
    ).start()
    yield f"https://127.0.0.1:{server.port}/v1"
    server.stop()


@pytest.fixture(scope="module")
def client(pki, mtls_upstream):
    def model(name: str, **tls: object) -> ModelConfig:
        return ModelConfig(
            name=name,
            provider="openai",
            model="gpt-4o-mini",
            api_base=mtls_upstream,
            api_key=API_KEY,
            **tls,
        )

    config = Config(
        models=[
            model(
                "secure",
                tls_client_cert=pki.client.cert_file,
                tls_client_key=pki.client.key_file,
                tls_ca_bundle=pki.ca.cert_file,
            ),
            model("no-cert", tls_ca_bundle=pki.ca.cert_file),
            model(
                "untrusted",
                tls_client_cert=pki.client.cert_file,
                tls_client_key=pki.client.key_file,
            ),
        ]
    )
    config.router.num_retries = 0
    with FakeServer(create_app(config), lifespan="on", loop="uvloop") as gw:
        yield openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)


def test_client_certificate_reaches_the_upstream(client):
    reply = client.chat.completions.create(
        model="secure", messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content == "echo: hi"
    stream = client.chat.completions.create(
        model="secure", messages=[{"role": "user", "content": "s"}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "echo: s"


@pytest.mark.parametrize("model", ["no-cert", "untrusted"])
def test_missing_certificate_or_untrusted_upstream_fails_cleanly(client, model):
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 502
    assert "cannot reach upstream" in e.value.body["message"]  # type: ignore[index]


def test_unreadable_upstream_tls_files_name_the_model(tmp_path):
    cfg = ModelConfig(
        name="m", provider="openai", model="x", tls_client_cert=tmp_path / "missing.pem"
    )
    with pytest.raises(TLSError, match="model 'm'"):
        upstream_ssl_context(cfg)
    assert upstream_ssl_context(ModelConfig(name="plain", provider="openai", model="x")) is None


def test_rotated_client_certificate_files_are_used_for_new_upstream_connections(
    pki, tmp_path, monkeypatch
):
    from flashstack.gateway.config import TLSConfig
    from flashstack.gateway.tls import ReloadingClientContext, ServerTLS, client_identity
    from tests.gateway.tls.certs import issue

    monkeypatch.setattr(ReloadingClientContext, "CHECK_INTERVAL", 0.05)
    seen: list[str] = []
    fake = openai_upstream.create_app(api_key=API_KEY)

    async def recording(scope, receive, send):  # the upstream notes which client certificate called
        if scope["type"] == "http":
            seen.append(client_identity(scope).serial)
        await fake(scope, receive, send)

    recording.state = fake.state  # type: ignore[attr-defined]
    upstream_tls = ServerTLS.from_config(
        TLSConfig(
            cert_file=pki.server.cert_file,
            key_file=pki.server.key_file,
            client_ca_file=pki.ca.cert_file,
        )
    )
    cert_file, key_file = tmp_path / "client.crt", tmp_path / "client.key"
    cert_file.write_bytes(pki.client.cert_pem)
    key_file.write_bytes(pki.client.key_pem)
    model = ModelConfig(
        name="gpt",
        provider="openai",
        model="gpt-4o-mini",
        api_key=API_KEY,
        tls_client_cert=cert_file,
        tls_client_key=key_file,
        tls_ca_bundle=pki.ca.cert_file,
    )
    with FakeServer(recording, timeout_keep_alive=1, **upstream_tls.uvicorn_options()) as up:
        model.api_base = f"https://127.0.0.1:{up.port}/v1"
        with FakeServer(create_app(Config(models=[model])), lifespan="on", loop="uvloop") as gw:
            client = openai.OpenAI(
                base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20
            )
            ask = lambda: client.chat.completions.create(  # noqa: E731
                model="gpt", messages=[{"role": "user", "content": "x"}]
            )
            assert ask().choices[0].message.content == "echo: x"
            renewed = issue(pki.ca, "client.test", dns=("client.test",), client=True)
            # half-written pair first: must not break anything
            key_file.write_bytes(renewed.key_pem)
            # the upstream closes the idle keep-alive connection: the next one is new
            time.sleep(1.3)
            assert ask().choices[0].message.content == "echo: x"
            # (health probes count too)
            assert set(seen) == {seen[0]}, "the previous certificate stays"
            cert_file.write_bytes(renewed.cert_pem)
            time.sleep(1.3)  # the upstream closes the idle keep-alive connection
            assert ask().choices[0].message.content == "echo: x"
    assert seen[0] == format(pki.client.cert.serial_number, "x")
    assert seen[-1] == format(renewed.cert.serial_number, "x")
