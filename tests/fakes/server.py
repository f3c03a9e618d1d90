"""Run an ASGI app with uvicorn on a free 127.0.0.1 port in a background thread.

with FakeServer(anthropic_upstream.create_app()) as srv:
    anthropic.Anthropic(base_url=srv.url, api_key="x")
    srv.requests, srv.cancelled        # the app's recordings
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class FakeServer:
    """A uvicorn server in a daemon thread; `start()`/`stop()` or use it as a context manager."""

    def __init__(self, app: Any, host: str = "127.0.0.1", **uvicorn_options: Any) -> None:
        self.app = app
        # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY on accepted connections only when
        # the listening socket says it is TCP; with proto 0 Nagle + delayed ACK add ~40 ms per
        # response.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.host, self.port = self._socket.getsockname()[:2]
        options = {
            "log_level": "warning",
            "access_log": False,
            "lifespan": "off",
            "http": "httptools",
            "timeout_graceful_shutdown": 1,
            **uvicorn_options,
        }
        self._server = uvicorn.Server(uvicorn.Config(app, **options))
        self._thread = threading.Thread(
            target=self._serve, name=f"fake-upstream-{self.port}", daemon=True
        )

    @property
    def url(self) -> str:
        """`http://127.0.0.1:PORT`, no trailing slash (OpenAI clients add `/v1` themselves)."""
        return f"http://{self.host}:{self.port}"

    @property
    def requests(self) -> list:
        return self.app.state.requests

    @property
    def cancelled(self) -> list:
        return self.app.state.cancelled

    def _serve(self) -> None:
        self._server.run(sockets=[self._socket])

    def start(self, timeout: float = 10.0) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"fake upstream on port {self.port} did not start")
            time.sleep(0.005)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout / 2)
        if self._thread.is_alive():  # open streams outlived the graceful period
            self._server.force_exit = True
            self._thread.join(timeout / 2)
        self._socket.close()

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
