"""`flashstack serve --tls-cert/--tls-key/--tls-client-ca`: a real process serving mTLS."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from flashstack.cli import _server_tls
from flashstack.gateway.config import Config, ConfigError, TLSConfig, VaultConfig
from tests.gateway.conftest import API_KEY
from tests.gateway.tls.certs import client_context
from tests.gateway.tls.openbao import free_port


def flags(cert=None, key=None, ca=None) -> argparse.Namespace:
    return argparse.Namespace(tls_cert=cert, tls_key=key, tls_client_ca=ca)


def test_flags_override_the_config_block(pki):
    vault = VaultConfig(addr="https://vault.example:8200", role="r", common_name="gw.example")
    config = Config(
        server={
            "tls": TLSConfig(
                vault=vault, client_names=["client.test"], client_ca_file=pki.other_ca.cert_file
            )
        }
    )
    tls = _server_tls(config, flags(pki.server.cert_file, pki.server.key_file, pki.ca.cert_file))
    assert tls is not None and tls.source.kind == "files"
    assert (
        config.server.tls.client_names == ["client.test"]
        and config.server.tls.client_ca_file == pki.ca.cert_file
    )
    assert _server_tls(Config(), flags()) is None  # no flags, no block: plain HTTP
    with pytest.raises(ConfigError, match="key_file"):
        _server_tls(Config(), flags(cert=pki.server.cert_file))


@pytest.mark.slow
def test_serve_with_tls_flags(pki, openai_upstream, tmp_path):
    port = free_port()
    config = tmp_path / "flashstack.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "models": [
                    {
                        "name": "gpt",
                        "provider": "openai",
                        "model": "gpt-4o-mini",
                        "api_base": openai_upstream.url + "/v1",
                        "api_key": API_KEY,
                    }
                ],
            }
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "flashstack.cli",
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        "--tls-cert",
        str(pki.server.cert_file),
        "--tls-key",
        str(pki.server.key_file),
        "--tls-client-ca",
        str(pki.ca.cert_file),
    ]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    try:
        good = httpx.Client(verify=client_context(pki.ca.cert_file, pki.client), timeout=10)
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read().decode()  # type: ignore[union-attr]
            try:
                ready = good.get(url + "/health/readiness")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the gateway did not come up"
                time.sleep(0.2)
        assert ready.status_code == 200, ready.text
        assert ready.json()["tls"]["status"] == "ok" and ready.json()["tls"]["source"] == "files"
        reply = good.post(
            url + "/v1/chat/completions",
            json={"model": "gpt", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert reply.json()["choices"][0]["message"]["content"] == "echo: hi"
        with pytest.raises(httpx.TransportError):  # no client certificate: refused
            httpx.Client(verify=client_context(pki.ca.cert_file), timeout=10).get(
                url + "/health/liveness"
            )
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{port}/health/liveness", timeout=10)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
