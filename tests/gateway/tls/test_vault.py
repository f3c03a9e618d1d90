"""Certificates from a real OpenBao PKI engine: issue, rotate under load, survive
Vault going away."""

from __future__ import annotations

import asyncio
import re
import ssl
import time

import httpx
import pytest

from flashstack.gateway.config import TLSConfig, VaultConfig
from flashstack.gateway.tls import ServerTLS, TLSError
from flashstack.gateway.tls.pki import VaultError, VaultIssuer
from tests.gateway.tls.certs import peer_serial
from tests.gateway.tls.conftest import CLIENT_NAME, TLSGateway
from tests.gateway.tls.openbao import CLIENT_ROLE, ROOT_TOKEN, SERVER_ROLE, BaoServer

pytestmark = pytest.mark.openbao
TOKEN_ENV = "FLASHSTACK_TEST_BAO_TOKEN"


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(TOKEN_ENV, ROOT_TOKEN)
    return ROOT_TOKEN


def vault_config(bao: BaoServer, **kw: object) -> VaultConfig:
    options: dict[str, object] = dict(
        addr=bao.addr,
        ca_bundle=bao.ca_file,
        token_env=TOKEN_ENV,
        role=SERVER_ROLE,
        common_name="gateway.test",
        ip_sans=["127.0.0.1"],
        ttl="1h",
        retry_min=0.2,
        retry_max=0.8,
    )
    return VaultConfig(**(options | kw))


@pytest.fixture(scope="module")
def client_ctx(bao, tmp_path_factory) -> ssl.SSLContext:
    """A caller with a client certificate issued by OpenBao's client role, trusting
    OpenBao's PKI root."""
    data = bao.client().secrets.pki.generate_certificate(
        name=CLIENT_ROLE, common_name=CLIENT_NAME, extra_params={"ttl": "10m"}
    )["data"]
    d = tmp_path_factory.mktemp("bao-client")
    (d / "client.crt").write_text(data["certificate"])
    (d / "client.key").write_text(data["private_key"])
    ctx = ssl.create_default_context(cafile=str(bao.root_file))
    ctx.load_cert_chain(d / "client.crt", d / "client.key")
    return ctx


def vault_tls(bao: BaoServer, **kw: object) -> ServerTLS:
    cfg = TLSConfig(
        vault=vault_config(bao, **kw), client_ca_file=bao.root_file, client_names=[CLIENT_NAME]
    )
    tls = ServerTLS.from_config(cfg)
    assert tls is not None
    return tls


async def new_connection(
    url: str, ctx: ssl.SSLContext, path: str = "/_test/whoami"
) -> tuple[int, httpx.Response]:
    async with httpx.AsyncClient(verify=ctx, timeout=20) as client:
        r = await client.get(url + path)
        return peer_serial(r.extensions["network_stream"]), r


def test_token_auth_issues_the_served_certificate(bao, token, openai_upstream, client_ctx):
    with TLSGateway(vault_tls(bao), openai_upstream.url) as gw:
        serial, r = asyncio.run(new_connection(gw.url, client_ctx))
        assert r.status_code == 200 and r.json()["identity"]["common_name"] == CLIENT_NAME
        assert serial == gw.tls.bundle.serial and gw.tls.bundle.subject == "CN=gateway.test"
        ready = asyncio.run(new_connection(gw.url, client_ctx, "/health/readiness"))[1]
        assert ready.status_code == 200
        report = ready.json()["tls"]
        assert (report["status"], report["source"], report["serial"]) == (
            "ok",
            "vault",
            gw.tls.bundle.serial_hex,
        )


def test_approle_auth(bao, monkeypatch):
    role_id, secret_id = bao.setup_approle()
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv("T_ROLE_ID", role_id)
    monkeypatch.setenv("T_SECRET_ID", secret_id)
    issuer = VaultIssuer(
        vault_config(bao, role_id_env="T_ROLE_ID", secret_id_env="T_SECRET_ID", ttl="5m")
    )
    issued = issuer.issue()
    assert "BEGIN CERTIFICATE" in issued.cert_pem and issuer.client.token != ROOT_TOKEN
    bao.client().auth.token.revoke(issuer.client.token)  # as if the AppRole token had expired
    assert issuer.issue().serial != issued.serial  # logged in again by itself
    monkeypatch.setenv("T_SECRET_ID", "not-the-secret")
    with pytest.raises(VaultError):  # a fresh login with a wrong secret is refused
        VaultIssuer(vault_config(bao, role_id_env="T_ROLE_ID", secret_id_env="T_SECRET_ID")).issue()


def test_no_credentials_says_which_variables_to_set(bao, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(VaultError, match=f"export \\${TOKEN_ENV}"):
        VaultIssuer(vault_config(bao, role_id_env="T_NONE_1", secret_id_env="T_NONE_2")).issue()


def test_vaults_own_certificate_is_verified(bao, token, pki):
    # Without the dev CA (system store only), or with a CA that did not sign Vault's
    # certificate: refused.
    for ca_bundle in (None, pki.other_ca.cert_file):
        with pytest.raises(VaultError, match="cannot verify"):
            VaultIssuer(vault_config(bao, ca_bundle=ca_bundle)).issue()
    with pytest.raises(VaultError, match="https"):
        VaultIssuer(vault_config(bao, addr="http://vault.example.com:8200"))
    # start-up fails loudly, after retries
    with pytest.raises(TLSError, match="no server certificate"):
        vault_tls(bao, ca_bundle=pki.other_ca.cert_file)


async def test_rotation_under_load_drops_nothing(bao, token, openai_upstream, client_ctx, tls_log):
    """50 streams open across a rotation (TTL 6 s, renewal at 2/3): all finish; new handshakes get
    the new serial."""
    chunks, interval = 40, 0.15  # each stream lasts ~6 s; the renewal comes at ~4 s
    with TLSGateway(vault_tls(bao, ttl="6s"), openai_upstream.url) as gw:
        first = gw.tls.bundle.serial

        async def stream() -> tuple[int, list[str]]:
            async with httpx.AsyncClient(verify=client_ctx, timeout=30) as client:
                async with client.stream(
                    "GET", gw.url + f"/_test/slow?chunks={chunks}&interval={interval}"
                ) as r:
                    assert r.status_code == 200
                    return peer_serial(r.extensions["network_stream"]), [
                        line async for line in r.aiter_lines()
                    ]

        async def probe(until: asyncio.Task) -> list[tuple[int, int]]:
            seen = []
            while not until.done():
                serial, r = await new_connection(gw.url, client_ctx)
                seen.append((serial, r.status_code))
                await asyncio.sleep(0.2)
            return seen

        streams = asyncio.ensure_future(asyncio.gather(*(stream() for _ in range(50))))
        probes = await probe(streams)
        results = await streams

        assert all(serial == first for serial, _ in results), (
            "every stream started on the first certificate"
        )
        assert all(
            lines == [f"chunk {i}" for i in range(chunks)] + ["done"] for _, lines in results
        )
        # renewed at 2/3 of the lifetime, not in a loop (Vault backdates 30 s)
        assert 1 <= gw.tls.rotations <= 3
        assert {status for _, status in probes} == {200}
        assert probes[0][0] == first and probes[-1][0] != first
        serial, r = await new_connection(gw.url, client_ctx)
        assert r.status_code == 200 and serial == gw.tls.bundle.serial != first
        assert "server certificate rotated" in tls_log.text


def test_vault_down_at_renewal_keeps_serving_until_expiry(
    tmp_path, token, openai_upstream, tls_log
):
    bao = BaoServer(tmp_path / "bao").start()
    try:
        bao.setup_pki()
        root_file, vault_ca = tmp_path / "root.pem", tmp_path / "vault-ca.pem"
        root_file.write_text(bao.client().secrets.pki.read_ca_certificate())
        vault_ca.write_bytes(bao.ca_file.read_bytes())  # bao deletes its dev CA when it stops
        cfg = TLSConfig(vault=vault_config(bao, ttl="5s", renew_at=0.4, ca_bundle=vault_ca))
        tls = ServerTLS.from_config(cfg)
    finally:
        bao.stop()  # Vault is gone before the first renewal is due
    assert tls is not None
    ctx = ssl.create_default_context(cafile=str(root_file))
    with TLSGateway(tls, openai_upstream.url) as gw:
        first, not_after = gw.tls.bundle.serial, gw.tls.bundle.not_after
        deadline = time.monotonic() + 10
        while tls.source.failures < 3:
            assert time.monotonic() < deadline, "renewal was not retried"
            time.sleep(0.05)

        serial, ready = asyncio.run(new_connection(gw.url, ctx, "/health/readiness"))
        assert serial == first, "the current certificate keeps serving"
        assert ready.status_code == 200
        assert ready.json()["tls"]["status"] == "warning"
        assert "cannot reach Vault" in ready.json()["tls"]["error"]
        assert "keeps serving until" in tls_log.text
        delays = [float(d) for d in re.findall(r"retrying in ([\d.]+) s", tls_log.text)]
        # doubling from retry_min up to retry_max, each wait jittered down to half (logged to
        # 0.01 s): the ranges of two attempts in a row touch, so only the bounds are exact
        bases = [min(cfg.vault.retry_max, cfg.vault.retry_min * 2**i) for i in range(3)]
        assert len(delays) >= 3, f"no retries logged: {delays}"
        assert all(b / 2 - 0.005 <= d <= b + 0.005 for d, b in zip(delays, bases)), (
            f"no backoff: {delays} against {bases}"
        )
        assert delays[2] > delays[0], f"no backoff: {delays}"

        while time.time() < not_after + 0.3:
            time.sleep(0.1)
        # the certificate expired: probe like a kubelet does
        unverified = ssl.create_default_context()
        unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
        _, ready = asyncio.run(new_connection(gw.url, unverified, "/health/readiness"))
        assert ready.status_code == 503
        assert ready.json()["tls"]["status"] == "expired"
        with pytest.raises(httpx.ConnectError, match="expired"):
            asyncio.run(new_connection(gw.url, ctx))
        deadline = time.monotonic() + 5
        while "EXPIRED" not in tls_log.text:
            assert time.monotonic() < deadline, "no log line says the certificate expired"
            time.sleep(0.05)


def test_renewal_recovers_when_vault_comes_back(tmp_path, token, tls_log):
    bao = BaoServer(tmp_path / "bao").start()
    try:
        bao.setup_pki()
        unseal_key = bao.unseal_key()
        tls = ServerTLS.from_config(TLSConfig(vault=vault_config(bao, ttl="4s", renew_at=0.25)))
        assert tls is not None
        first = tls.bundle.serial
        bao.client().sys.seal()  # sealed: Vault answers 503 to everything
        tls.start()
        try:
            deadline = time.monotonic() + 8
            while tls.source.failures < 2:
                assert time.monotonic() < deadline, "renewal was not retried"
                time.sleep(0.05)
            assert tls.status()["status"] == "warning" and tls.bundle.serial == first
            bao.client().sys.submit_unseal_key(unseal_key)
            while tls.bundle.serial == first:
                assert time.monotonic() < deadline, "renewal did not recover once Vault was back"
                time.sleep(0.05)
            assert tls.status()["status"] == "ok" and tls.source.failures == 0
            assert "Vault is back" in tls_log.text
        finally:
            tls.close()
    finally:
        bao.stop()
