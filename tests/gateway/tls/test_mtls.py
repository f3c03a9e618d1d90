"""mTLS: a verified client certificate gets in and is visible to auth; every bad one is refused."""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest

from flashstack.gateway.config import ConfigError, TLSConfig
from flashstack.gateway.tls import ServerTLS
from tests.gateway.tls.certs import client_context
from tests.gateway.tls.conftest import CLIENT_NAME, PKI, TLSGateway


def mtls_config(pki: PKI, **kw: object) -> TLSConfig:
    return TLSConfig(
        cert_file=pki.server.cert_file,
        key_file=pki.server.key_file,
        client_ca_file=pki.ca.cert_file,
        client_names=[CLIENT_NAME, "svc-*.test"],
        **kw,
    )


@pytest.fixture(scope="module")
def gateway(pki: PKI, openai_upstream):
    with TLSGateway(ServerTLS.from_config(mtls_config(pki)), openai_upstream.url) as gw:
        yield gw


def whoami(gateway: TLSGateway, ctx: ssl.SSLContext) -> httpx.Response:
    with httpx.Client(verify=ctx, timeout=10) as client:
        return client.get(gateway.url + "/_test/whoami")


def test_valid_client_certificate_connects_and_its_identity_reaches_the_request(gateway, pki):
    r = whoami(gateway, client_context(pki.ca.cert_file, pki.client))
    assert r.status_code == 200
    body = r.json()
    assert body["state"] is True  # request.state.client_cert
    assert body["identity"]["common_name"] == CLIENT_NAME
    assert body["identity"]["dns_names"] == [CLIENT_NAME]
    assert body["identity"]["serial"] == format(pki.client.cert.serial_number, "x")
    assert body["client_cert_name"] == f"CN={CLIENT_NAME}"
    assert body["tls_version"] in (0x0303, 0x0304)


@pytest.mark.parametrize("bad", ["none", "foreign", "expired", "wrong_name", "server_usage"])
def test_bad_client_certificate_is_refused_and_the_server_keeps_serving(gateway, pki, bad):
    client = None if bad == "none" else getattr(pki, bad)
    hits = gateway.app.state.hits
    for _ in range(8):  # the request races the server's verdict: it must lose every time
        # TLS 1.3 reports the client's failure on first read
        with pytest.raises(httpx.TransportError):
            whoami(gateway, client_context(pki.ca.cert_file, client))
    assert gateway.app.state.hits == hits, "a refused connection must never reach the app"
    assert whoami(gateway, client_context(pki.ca.cert_file, pki.client)).status_code == 200


def test_tls_below_1_2_is_refused(gateway, pki):
    ctx = client_context(
        pki.ca.cert_file,
        pki.client,
        minimum_version=ssl.TLSVersion.TLSv1,
        maximum_version=ssl.TLSVersion.TLSv1_1,
    )
    ctx.set_ciphers("ALL:@SECLEVEL=0")
    with pytest.raises(httpx.TransportError):
        whoami(gateway, ctx)


def test_tls_1_2_handshake_rejects_a_foreign_certificate_during_the_handshake(gateway, pki):
    # In TLS 1.2 the server verifies the client before the handshake ends: the connect itself fails.
    ctx = client_context(pki.ca.cert_file, pki.foreign, maximum_version=ssl.TLSVersion.TLSv1_2)
    with pytest.raises(httpx.ConnectError):
        whoami(gateway, ctx)
    ok = client_context(pki.ca.cert_file, pki.client, maximum_version=ssl.TLSVersion.TLSv1_2)
    assert whoami(gateway, ok).json()["tls_version"] == 0x0303


def test_sdk_chat_over_mtls(gateway, pki):
    http = httpx.Client(verify=client_context(pki.ca.cert_file, pki.client), timeout=20)
    client = openai.OpenAI(
        base_url=gateway.url + "/v1", api_key="unused", max_retries=0, http_client=http
    )
    reply = client.chat.completions.create(
        model="gpt", messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content == "echo: hi"
    chunks = client.chat.completions.create(
        model="gpt", messages=[{"role": "user", "content": "over tls"}], stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo: over tls"
    )


def test_server_certificate_is_verified_by_clients(gateway, pki):
    # A client that trusts another CA refuses the gateway: proves the gateway serves the
    # configured chain.
    with pytest.raises(httpx.ConnectError):
        whoami(gateway, client_context(pki.other_ca.cert_file, pki.client))


def test_optional_client_auth_admits_clients_without_a_certificate(pki, openai_upstream):
    cfg = TLSConfig(
        cert_file=pki.server.cert_file,
        key_file=pki.server.key_file,
        client_ca_file=pki.ca.cert_file,
        client_auth="optional",
    )
    with TLSGateway(ServerTLS.from_config(cfg), openai_upstream.url) as gw:
        anonymous = whoami(gw, client_context(pki.ca.cert_file))
        assert anonymous.status_code == 200 and anonymous.json()["identity"] is None
        assert (
            whoami(gw, client_context(pki.ca.cert_file, pki.client)).json()["identity"][
                "common_name"
            ]
            == CLIENT_NAME
        )
        with pytest.raises(httpx.TransportError):  # a certificate, if sent, must still verify
            whoami(gw, client_context(pki.ca.cert_file, pki.foreign))


def test_bad_tls_config_says_what_to_fix(pki, tmp_path):
    with pytest.raises(ValueError, match="needs server.tls.key_file"):
        TLSConfig(cert_file=pki.server.cert_file)
    with pytest.raises(ConfigError, match="does not load with its key"):
        ServerTLS.from_config(
            TLSConfig(cert_file=pki.server.cert_file, key_file=pki.client.key_file)
        )
    with pytest.raises(ConfigError, match="cannot read"):
        ServerTLS.from_config(
            TLSConfig(cert_file=tmp_path / "nope.crt", key_file=tmp_path / "nope.key")
        )
    with pytest.raises(ConfigError, match="client_ca_file"):
        ServerTLS.from_config(
            TLSConfig(
                cert_file=pki.server.cert_file,
                key_file=pki.server.key_file,
                client_ca_file=tmp_path / "missing-ca.pem",
            )
        )
