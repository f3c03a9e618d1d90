"""Stores, gateways (in a thread or as processes) and small clients for the session
and auth tests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import yaml

from flashstack.gateway.app import create_app
from flashstack.gateway.config import AuthConfig, Config, ModelConfig, ServerConfig, StoreConfig
from tests.fakes.server import FakeServer
from tests.gateway.conftest import API_KEY

PG_URL = "postgresql+asyncpg://127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/0"
MASTER_KEY = "sk-master-for-tests"


def pg_available() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=0.5):
            return True
    except OSError:
        return False


def redis_available() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=0.5):
            return True
    except OSError:
        return False


class ScratchStore:
    """A fresh database: a SQLite file under `tmp`, or a PostgreSQL schema of its own."""

    def __init__(self, kind: str, tmp: Path) -> None:
        self.kind = kind
        self.schema = (
            f"fs_test_{os.getpid()}_{uuid.uuid4().hex[:8]}" if kind == "postgres" else None
        )
        self.url = PG_URL if kind == "postgres" else f"sqlite+aiosqlite:///{tmp / 'flashstack.db'}"

    def config(self) -> StoreConfig:
        return StoreConfig(
            database_url=self.url, db_schema=self.schema, lease_ttl=5.0, lock_timeout=60.0
        )

    def drop(self) -> None:
        if self.schema is None:
            return

        async def drop() -> None:
            import asyncpg

            conn = await asyncpg.connect("postgresql://127.0.0.1:5432/test")
            await conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
            await conn.close()

        asyncio.run(drop())

    def query(self, sql: str, *args: Any) -> list[Any]:
        """Rows of `sql` run directly on the database (asyncpg / sqlite3 parameter style `?`)."""
        if self.kind == "postgres":

            async def run() -> list[Any]:
                import asyncpg

                conn = await asyncpg.connect(
                    "postgresql://127.0.0.1:5432/test", server_settings={"search_path": self.schema}
                )
                n = iter(range(1, 100))
                rows = await conn.fetch(
                    "".join(f"${next(n)}" if c == "?" else c for c in sql), *args
                )
                await conn.close()
                return [tuple(r) for r in rows]

            # A thread of its own, so this also works from inside a running event loop.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                return pool.submit(asyncio.run, run()).result()
        import sqlite3

        with sqlite3.connect(self.url.removeprefix("sqlite+aiosqlite:///")) as conn:
            return conn.execute(sql, args).fetchall()


def models(upstreams: Any) -> list[ModelConfig]:
    return [
        ModelConfig(
            name="gpt",
            provider="openai",
            model="gpt-4o-mini",
            api_base=upstreams["openai"].url + "/v1",
            api_key=API_KEY,
        ),
        ModelConfig(
            name="claude",
            provider="anthropic",
            model="claude-sonnet-4-5",
            api_base=upstreams["anthropic"].url,
            api_key=API_KEY,
        ),
    ]


def gateway_config(
    upstreams: Any,
    store: ScratchStore,
    tmp: Path,
    master_key: str | None = MASTER_KEY,
    redis_url: str | None = None,
    **store_overrides: Any,
) -> Config:
    store_cfg = store.config().model_copy(update=store_overrides)
    return Config(
        server=ServerConfig(max_body_bytes=4 * 1024 * 1024),
        models=models(upstreams),
        store=store_cfg,
        auth=AuthConfig(
            master_key=master_key,
            redis_url=redis_url,
            redis_prefix=f"fs-test-{uuid.uuid4().hex[:8]}:",
        ),
        state_dir=tmp,
    )


def start_gateway(config: Config) -> FakeServer:
    return FakeServer(create_app(config), lifespan="on", loop="uvloop").start()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    """`flashstack serve` as its own process (so it can be SIGKILLed), on a fixed port."""

    def __init__(self, config: Config, tmp: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.path = tmp / f"gateway-{self.port}.yaml"
        self.path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tmp / f"gateway-{self.port}.log"

    def start(self, timeout: float = 60) -> GatewayProcess:
        return self.launch().wait_ready(timeout)

    def launch(self) -> GatewayProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHSTACK_")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flashstack.cli",
                "serve",
                "--config",
                str(self.path),
                "--port",
                str(self.port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("ab"),
            env=env,
        )
        return self

    def wait_ready(self, timeout: float = 60) -> GatewayProcess:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health/liveness", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"gateway did not start: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def auth_headers(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


def create_key(url: str, **fields: Any) -> dict[str, Any]:
    r = httpx.post(
        url + "/v1/keys", json={"name": "test", **fields}, headers=auth_headers(MASTER_KEY)
    )
    assert r.status_code == 200, r.text
    return r.json()
