"""CPU the server limits add per request: docs/benchmarks.md, "Server limits"."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import uvloop
from uvicorn.config import Config as UvicornConfig
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from flashstack.gateway.browser_guard import BrowserGuard
from flashstack.gateway.config import Config, ServerConfig
from flashstack.gateway.server_limits import ConnectionLimits, limited_protocol

BODY = b'{"model": "gpt", "messages": [{"role": "user", "content": "hi"}]}'
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8400\r\nUser-Agent: OpenAI/Python "
    b"1.99.0\r\n"
    b"Accept: application/json\r\nContent-Type: application/json\r\nAuthorization: Bearer "
    b"sk-x\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


class Transport(asyncio.Transport):
    """Counts responses; everything else a protocol asks of a transport is a no-op."""

    def __init__(self) -> None:
        super().__init__()
        self.responses = 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8400)}.get(
            name, default
        )

    def write(self, data: bytes) -> None:
        if data.startswith(b"HTTP/1.1"):
            self.responses += 1

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def close(self) -> None: ...

    def can_write_eof(self) -> bool:
        return False


async def app(scope: dict, receive: Any, send: Any) -> None:
    await receive()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")],
        }
    )
    await send({"type": "http.response.body", "body": b"{}"})


async def serve(protocol_class: type, n: int) -> float:
    """CPU seconds per request for `n` keep-alive requests on one connection."""
    config = UvicornConfig(app, http=protocol_class, lifespan="off", access_log=False)
    config.load()
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    t0 = time.process_time()
    for _ in range(n):
        protocol.data_received(REQUEST)
        while protocol.cycle is not None and not protocol.cycle.response_complete:
            await asyncio.sleep(0)
    cpu = time.process_time() - t0
    assert transport.responses == n, transport.responses
    protocol.connection_lost(None)
    return cpu / n


def guard_cost(n: int) -> float:
    guard = BrowserGuard.from_config(Config())
    assert guard is not None
    headers = [
        tuple(line.split(b": ", 1)) for line in REQUEST.split(b"\r\n\r\n")[0].split(b"\r\n")[1:]
    ]
    scope = {"method": "POST", "headers": [(k.lower(), v) for k, v in headers]}
    t0 = time.process_time()
    for _ in range(n):
        guard.check(scope)
    return (time.process_time() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    limited = limited_protocol(ConnectionLimits.from_config(ServerConfig()))
    rounds: dict[str, list[float]] = {"uvicorn_httptools": [], "with_server_limits": []}
    for _ in range(args.rounds):
        for name, cls in (
            ("uvicorn_httptools", HttpToolsProtocol),
            ("with_server_limits", limited),
        ):
            rounds[name].append(uvloop.run(serve(cls, args.requests)) * 1e6)
    plain, ours = (
        statistics.median(rounds["uvicorn_httptools"]),
        statistics.median(rounds["with_server_limits"]),
    )
    print(
        json.dumps(
            {
                "bench": "server_limits_overhead",
                "requests_per_round": args.requests,
                "us_per_request_median": {
                    "uvicorn_httptools": round(plain, 2),
                    "with_server_limits": round(ours, 2),
                },
                "added_us_per_request": round(ours - plain, 2),
                "rounds_us": {k: [round(v, 2) for v in vs] for k, vs in rounds.items()},
                "browser_guard_check_us": round(guard_cost(args.requests * 5) * 1e6, 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
