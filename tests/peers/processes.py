"""Real servers as child processes: each on an ephemeral port, ready within a bound, killed after.

Each is asked for port 0 and the port it really bound is read from /proc (the listening TCP
socket among the process's descriptors), whatever the server logs, so no port is ever guessed or
reserved. A restart asks for the port the process had before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / ".peers"


def peer_executable(venv: str, exe: str) -> Path:
    """A program in one of the peers' venvs (`make peers`); a clear failure, never a skip, without
    it."""
    path = PEERS / venv / "bin" / exe
    if not (PEERS / venv / ".installed").exists() or not path.exists():
        pytest.fail(
            f"{venv} is not installed ({path} is missing): run `make peers` (`make test` does it "
            "first)",
            pytrace=False,
        )
    return path


def listening_ports(pid: int) -> set[int]:
    """TCP ports that process `pid` listens on (IPv4 and IPv6), from /proc."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


class PeerProcess:
    """One real server: `argv_for(port)` is its command line (port 0 on the first start)."""

    def __init__(
        self,
        name: str,
        argv_for: Callable[[int], list[str]],
        log_dir: Path,
        env: dict[str, str] | None = None,
        ready_path: str = "/v1/models",
        ready_headers: dict[str, str] | None = None,
    ) -> None:
        self.name, self.argv_for, self.env = name, argv_for, env or {}
        self.ready_path, self.ready_headers = ready_path, ready_headers or {}
        self.log_dir = log_dir
        self.log_file = log_dir / f"{name}.log"
        self.port = 0
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> PeerProcess:
        """Start (or restart on the same port) and wait until `ready_path` answers 200."""
        self.starts += 1
        self.log_file = self.log_dir / f"{self.name}.{self.starts}.log"
        with open(self.log_file, "wb") as out:
            # Its own session: a SIGKILL of the group takes the server's children (workers) too.
            self.popen = subprocess.Popen(
                self.argv_for(self.port),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                cwd=ROOT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        self.port = self._bound_port(deadline) if self.port == 0 else self.port
        self._wait_ready(deadline)
        return self

    def _bound_port(self, deadline: float) -> int:
        assert self.popen is not None
        while time.monotonic() < deadline:
            ports = listening_ports(self.popen.pid)
            if ports:
                return min(ports)
            self._check_alive()
            time.sleep(0.1)
        self._give_up("did not listen on a port")

    def _wait_ready(self, deadline: float) -> None:
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                self._check_alive()
                try:
                    if (
                        client.get(
                            self.url + self.ready_path, headers=self.ready_headers
                        ).status_code
                        == 200
                    ):
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self._give_up(f"did not answer GET {self.ready_path} with 200")

    def _check_alive(self) -> None:
        assert self.popen is not None
        if self.popen.poll() is not None:
            self._give_up(f"exited with status {self.popen.returncode}")

    def _give_up(self, what: str) -> None:
        self.stop()
        tail = self.log_file.read_bytes()[-3000:].decode(errors="replace")
        pytest.fail(
            f"{self.name} {what} within its start-up bound; its log ({self.log_file}) "
            f"ends:\n{tail}",
            pytrace=False,
        )

    def kill(self) -> None:
        """SIGKILL, as a crash would: no graceful close of open connections."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self._signal(signal.SIGTERM, wait=10.0)
        if self.popen.poll() is None:
            self._signal(signal.SIGKILL)

    def _signal(self, sig: int, wait: float = 10.0) -> None:
        assert self.popen is not None
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(wait)
        except subprocess.TimeoutExpired:
            pass
