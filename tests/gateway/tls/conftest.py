"""Certificates, a real OpenBao, and a real gateway serving HTTPS with a rotating certificate."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from flashstack.gateway.app import create_app
from flashstack.gateway.config import Config, ModelConfig, ServerConfig
from flashstack.gateway.tls import ServerTLS, client_identity
from tests.fakes.server import FakeServer
from tests.gateway.conftest import API_KEY
from tests.gateway.tls.certs import Issued, issue, make_ca
from tests.gateway.tls.openbao import BaoServer

CLIENT_NAME = "client.test"


class PKI:
    """A test CA with a server certificate for 127.0.0.1, and good and bad client certificates."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.ca = make_ca("flashstack test CA").write(d, "ca")
        self.other_ca = make_ca("some other CA").write(d, "other-ca")
        self.server = self.server_cert("server")
        past = datetime.now(UTC) - timedelta(days=2)
        self.client = issue(self.ca, CLIENT_NAME, dns=(CLIENT_NAME,), client=True).write(
            d, "client"
        )
        self.foreign = issue(self.other_ca, CLIENT_NAME, dns=(CLIENT_NAME,), client=True).write(
            d, "foreign"
        )
        self.expired = issue(
            self.ca,
            CLIENT_NAME,
            dns=(CLIENT_NAME,),
            client=True,
            not_before=past,
            not_after=past + timedelta(hours=1),
        ).write(d, "expired")
        self.wrong_name = issue(
            self.ca, "intruder.example", dns=("intruder.example",), client=True
        ).write(d, "wrong")
        # no clientAuth
        self.server_usage = issue(self.ca, CLIENT_NAME, dns=(CLIENT_NAME,)).write(d, "server-usage")

    def server_cert(self, stem: str, **kw: object) -> Issued:
        return issue(self.ca, "gateway.test", dns=("localhost",), ips=("127.0.0.1",), **kw).write(
            self.dir, stem
        )  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return PKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def bao(tmp_path_factory: pytest.TempPathFactory):
    """One OpenBao dev server (TLS) with the PKI engine, shared by the Vault tests."""
    server = BaoServer(tmp_path_factory.mktemp("bao")).start()
    server.root_pem = server.setup_pki()  # type: ignore[attr-defined]
    server.root_file = server.dir / "pki-root.pem"  # type: ignore[attr-defined]
    server.root_file.write_text(server.root_pem)  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture(scope="session")
def openai_upstream():
    from tests.fakes import openai_upstream as fake

    server = FakeServer(fake.create_app(api_key=API_KEY)).start()
    yield server
    server.stop()


def tls_app(config: Config, tls: ServerTLS) -> FastAPI:
    """The gateway app plus two probe routes: who am I (the mTLS identity) and a slow
    finite stream."""
    app = create_app(config, tls=tls)
    app.state.hits = 0

    @app.get("/_test/whoami")
    async def whoami(request: Request) -> JSONResponse:
        request.app.state.hits += 1
        identity = client_identity(request)
        tls_ext = request.scope.get("extensions", {}).get("tls", {})
        return JSONResponse(
            {
                "identity": asdict(identity) if identity else None,
                "state": bool(getattr(request.state, "client_cert", None)),
                "tls_version": tls_ext.get("tls_version"),
                "client_cert_name": tls_ext.get("client_cert_name"),
            }
        )

    @app.get("/_test/slow")
    async def slow(chunks: int, interval: float) -> StreamingResponse:
        async def body():
            for i in range(chunks):
                yield f"chunk {i}\n".encode()
                await asyncio.sleep(interval)
            yield b"done\n"

        return StreamingResponse(body(), media_type="text/plain")

    return app


class TLSGateway:
    """A real gateway (uvicorn in a thread) serving HTTPS with `tls`; `url` is https://127.0.0.1:PORT."""

    def __init__(self, tls: ServerTLS, upstream_url: str, **uvicorn: object) -> None:
        self.tls = tls
        config = Config(
            server=ServerConfig(),
            models=[
                ModelConfig(
                    name="gpt",
                    provider="openai",
                    model="gpt-4o-mini",
                    api_base=upstream_url + "/v1",
                    api_key=API_KEY,
                )
            ],
        )
        self.app = tls_app(config, tls)
        options = {"lifespan": "on", "loop": "asyncio", **uvicorn}
        options |= tls.uvicorn_options(str(options.pop("http", "httptools")))
        self.server = FakeServer(self.app, **options)
        self.url = f"https://127.0.0.1:{self.server.port}"

    def __enter__(self) -> TLSGateway:
        self.tls.start()
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
        self.tls.close()


@pytest.fixture
def tls_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="flashstack.tls")
    return caplog
