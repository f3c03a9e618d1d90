"""Certificate files are watched: a new pair is served to new handshakes without a restart."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from flashstack.gateway.config import TLSConfig
from flashstack.gateway.tls import ServerTLS
from tests.gateway.tls.certs import Issued, client_context, issue, peer_serial
from tests.gateway.tls.conftest import PKI, TLSGateway


def replace_files(cert: Issued, cert_file, key_file) -> None:
    """Atomic swap, as cert-manager or a Vault agent does it."""
    for data, target in ((cert.cert_pem, cert_file), (cert.key_pem, key_file)):
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def new_connection_serial(gw: TLSGateway, pki: PKI) -> int:
    with httpx.Client(verify=client_context(pki.ca.cert_file, pki.client), timeout=10) as c:
        r = c.get(gw.url + "/_test/whoami")
        assert r.status_code == 200
        return peer_serial(r.extensions["network_stream"])


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # `flashstack serve` runs uvloop
def test_changed_files_are_served_to_new_connections_while_open_ones_keep_theirs(
    pki, openai_upstream, tmp_path, tls_log, loop
):
    first = pki.server_cert("rot-1")
    cert_file, key_file = tmp_path / "tls.crt", tmp_path / "tls.key"
    replace_files(first, cert_file, key_file)
    cfg = TLSConfig(
        cert_file=cert_file, key_file=key_file, client_ca_file=pki.ca.cert_file, watch_interval=0.1
    )
    with (
        TLSGateway(ServerTLS.from_config(cfg), openai_upstream.url, loop=loop) as gw,
        httpx.Client(verify=client_context(pki.ca.cert_file, pki.client), timeout=10) as kept,
    ):
        r = kept.get(gw.url + "/_test/whoami")
        assert peer_serial(r.extensions["network_stream"]) == first.cert.serial_number

        second = pki.server_cert("rot-2")
        replace_files(second, cert_file, key_file)
        wait_for(lambda: gw.tls.bundle.serial == second.cert.serial_number)

        assert new_connection_serial(gw, pki) == second.cert.serial_number
        r = kept.get(gw.url + "/_test/whoami")  # the keep-alive connection from before the swap
        assert r.status_code == 200
        assert peer_serial(r.extensions["network_stream"]) == first.cert.serial_number
        assert gw.tls.rotations == 1
        assert "server certificate rotated" in tls_log.text


def test_a_broken_pair_keeps_the_current_certificate_and_warns_until_fixed(
    pki, openai_upstream, tmp_path, tls_log
):
    good = pki.server_cert("broken-1")
    cert_file, key_file = tmp_path / "tls.crt", tmp_path / "tls.key"
    replace_files(good, cert_file, key_file)
    cfg = TLSConfig(
        cert_file=cert_file, key_file=key_file, client_ca_file=pki.ca.cert_file, watch_interval=0.1
    )
    with TLSGateway(ServerTLS.from_config(cfg), openai_upstream.url) as gw:
        nxt = pki.server_cert("broken-2")
        cert_file.write_bytes(nxt.cert_pem)  # the certificate lands, its key not yet
        wait_for(lambda: gw.tls.source.error is not None)
        assert "does not load with its key" in gw.tls.source.error
        assert gw.tls.status()["status"] == "warning"
        assert new_connection_serial(gw, pki) == good.cert.serial_number
        readiness = _readiness(gw, pki)
        assert readiness.status_code == 200 and readiness.json()["tls"]["status"] == "warning"

        key_file.write_bytes(nxt.key_pem)
        wait_for(lambda: gw.tls.bundle.serial == nxt.cert.serial_number)
        assert gw.tls.source.error is None and gw.tls.status()["status"] == "ok"
        assert new_connection_serial(gw, pki) == nxt.cert.serial_number
        assert "the current one keeps serving" in tls_log.text


def test_an_expired_file_certificate_makes_readiness_fail(pki, openai_upstream, tmp_path):
    soon = datetime.now(UTC) + timedelta(seconds=2)
    short = pki.server_cert("short", not_after=soon)
    cfg = TLSConfig(
        cert_file=short.cert_file, key_file=short.key_file, client_ca_file=pki.ca.cert_file
    )
    with TLSGateway(ServerTLS.from_config(cfg), openai_upstream.url) as gw:
        assert gw.tls.status()["status"] in ("ok", "warning")
        wait_for(lambda: time.time() > soon.timestamp() + 0.5)
        r = _readiness(gw, pki, verify_server=False)
        assert r.status_code == 503
        assert r.json()["tls"]["status"] == "expired"


def _readiness(gw: TLSGateway, pki: PKI, verify_server: bool = True) -> httpx.Response:
    ctx = client_context(pki.ca.cert_file, pki.client)
    # the server certificate has expired: probe like a kubelet, which does not verify
    if not verify_server:
        ctx.check_hostname = False
        ctx.verify_mode = __import__("ssl").CERT_NONE
    with httpx.Client(verify=ctx, timeout=10) as c:
        return c.get(gw.url + "/health/readiness")


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    yield
    import threading

    assert not [t for t in threading.enumerate() if t.name == "flashstack-tls-renewal"]


def test_a_new_client_ca_applies_to_new_handshakes(pki, openai_upstream, tmp_path):
    from tests.gateway.tls.certs import make_ca

    ca_file = tmp_path / "clients-ca.pem"
    ca_file.write_bytes(pki.ca.cert_pem)
    cfg = TLSConfig(
        cert_file=pki.server.cert_file,
        key_file=pki.server.key_file,
        client_ca_file=ca_file,
        watch_interval=0.1,
    )
    new_ca = make_ca("next client CA")
    newcomer = issue(new_ca, "svc-b.test", client=True).write(tmp_path, "newcomer")
    with TLSGateway(ServerTLS.from_config(cfg), openai_upstream.url) as gw:

        def status(client: Issued) -> int | None:
            try:
                with httpx.Client(verify=client_context(pki.ca.cert_file, client), timeout=10) as c:
                    return c.get(gw.url + "/_test/whoami").status_code
            except httpx.TransportError:
                return None

        assert status(pki.client) == 200 and status(newcomer) is None
        tmp = ca_file.with_suffix(".tmp")
        tmp.write_bytes(new_ca.cert_pem)
        os.replace(tmp, ca_file)
        wait_for(lambda: gw.tls.rotations == 1)
        assert status(newcomer) == 200 and status(pki.client) is None
