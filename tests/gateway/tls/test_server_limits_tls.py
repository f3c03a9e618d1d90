"""The server limits hold over HTTPS too: the TLS protocol class is built on the limited one."""

from __future__ import annotations

import socket
import ssl
import time

import httpx
import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig, ServerConfig, TLSConfig
from flashstack.gateway.server_limits import uvicorn_options
from flashstack.gateway.tls import ServerTLS
from tests.fakes.server import FakeServer
from tests.gateway.conftest import API_KEY
from tests.gateway.tls.certs import client_context
from tests.gateway.tls.conftest import PKI


@pytest.fixture(scope="module")
def gateway(pki: PKI, openai_upstream):
    tls = ServerTLS.from_config(
        TLSConfig(cert_file=pki.server.cert_file, key_file=pki.server.key_file)
    )
    server = ServerConfig(max_header_bytes=8192, header_timeout=0.5, tls=tls.cfg)
    config = Config(
        server=server,
        models=[
            ModelConfig(
                name="gpt",
                provider="openai",
                model="gpt-4o-mini",
                api_base=openai_upstream.url + "/v1",
                api_key=API_KEY,
            )
        ],
    )
    fake = FakeServer(
        create_app(config), lifespan="on", loop="uvloop", **uvicorn_options(server, tls.start())
    )
    fake.start()
    yield fake, client_context(pki.ca.cert_file)
    fake.stop()
    tls.close()


def _tls_socket(gateway) -> ssl.SSLSocket:
    fake, ctx = gateway
    return ctx.wrap_socket(
        socket.create_connection((fake.host, fake.port), timeout=5), server_hostname="127.0.0.1"
    )


def _read_all(s: ssl.SSLSocket) -> bytes:
    """Until the close, or until a reply's Content-Length is in (TLS has no half-close
    to wait for)."""
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
            head, sep, body = out.partition(b"\r\n\r\n")
            length = [
                line.split(b":")[1]
                for line in head.lower().split(b"\r\n")
                if line.startswith(b"content-length:")
            ]
            if sep and length and len(body) >= int(length[0]):
                break
    except (ConnectionResetError, ssl.SSLError):
        pass
    return out


def test_oversized_header_over_tls_gets_431_json(gateway):
    with _tls_socket(gateway) as s:
        s.sendall(
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
        )
        raw = _read_all(s)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431")
    assert b"server.max_header_bytes" in body and body.startswith(b'{"error":')


def test_idle_tls_connection_is_closed_then_a_normal_request_succeeds(gateway):
    t0 = time.monotonic()
    with _tls_socket(gateway) as s:
        assert _read_all(s) == b""
    assert time.monotonic() - t0 < 2.0
    fake, ctx = gateway
    with httpx.Client(verify=ctx, timeout=5) as c:
        r = c.post(
            f"https://127.0.0.1:{fake.port}/v1/chat/completions",
            json={"model": "gpt", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "echo: hi"
