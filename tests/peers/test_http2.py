"""An HTTP/2 upstream over TLS (ALPN h2, hypercorn): the gateway's pooled client multiplexes.

Fifty concurrent streams through the gateway must reach the upstream as fifty HTTP/2 streams of one
TLS connection, all in flight at once, as the upstream itself counts them. The app behind hypercorn
is the faithful OpenAI fake; what is real here is the transport on both sides.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import dataclass, field

import openai
import pytest
from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig

from flashstack.gateway.config import ModelConfig
from tests.fakes import openai_upstream
from tests.gateway.tls.certs import issue, make_ca
from tests.peers.conftest import PLAIN_ROUTING, start_gateway

API_KEY = "sk-h2-upstream"
STREAMS = 50
# each chat waits this long before answering, so that every stream is in flight together
HOLD_S = 0.5


@dataclass
class StreamCounter:
    """ASGI middleware: the HTTP version and TCP peer of every chat request, and how many
    overlap."""

    app: object
    seen: list[tuple[str, tuple[str, int]]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            return await self.app(scope, receive, send)
        self.seen.append((scope["http_version"], tuple(scope["client"])))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(HOLD_S)
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class H2Upstream:
    """hypercorn serving `app` over TLS with ALPN h2 on an ephemeral port, in a thread of its
    own."""

    def __init__(self, app, cert_file, key_file) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self.config = HypercornConfig()
        # hypercorn owns (and closes) the socket from here
        self.config.bind = [f"fd://{sock.detach()}"]
        self.config.certfile, self.config.keyfile = str(cert_file), str(key_file)
        # HTTP/2 or nothing: an HTTP/1.1 client cannot pass unseen
        self.config.alpn_protocols = ["h2"]
        self.config.accesslog = self.config.errorlog = None
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.stopping = asyncio.Event()
        self.thread = threading.Thread(target=self._run, name="h2-upstream", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(
            serve(self.app, self.config, shutdown_trigger=self.stopping.wait)
        )

    def start(self) -> H2Upstream:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(10)


@pytest.fixture(scope="module")
def h2_gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("h2")
    ca = make_ca("flashstack test CA").write(tmp, "ca")
    leaf = issue(ca, "localhost", dns=("localhost",), ips=("127.0.0.1",)).write(tmp, "upstream")
    counter = StreamCounter(openai_upstream.create_app(api_key=API_KEY))
    upstream = H2Upstream(counter, leaf.cert_file, leaf.key_file).start()
    model = ModelConfig(
        name="h2",
        provider="openai",
        model="gpt-4o-mini",
        api_key=API_KEY,
        api_base=f"https://127.0.0.1:{upstream.port}/v1",
        tls_ca_bundle=ca.cert_file,
    )
    gateway = start_gateway([model], PLAIN_ROUTING, tmp / "state")
    yield gateway, counter
    gateway.stop()
    upstream.stop()


async def _stream(client: openai.AsyncOpenAI, i: int) -> str:
    stream = await client.chat.completions.create(
        model="h2", messages=[{"role": "user", "content": f"stream {i}"}], stream=True
    )
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


def test_concurrent_streams_share_one_http2_connection(h2_gateway):
    gateway, counter = h2_gateway

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30
        )
        async with asyncio.timeout(30):
            return await asyncio.gather(*(_stream(client, i) for i in range(STREAMS)))

    texts = asyncio.run(run())
    assert texts == [f"echo: stream {i}" for i in range(STREAMS)]
    assert len(counter.seen) == STREAMS
    assert {version for version, _ in counter.seen} == {"2"}
    assert len({peer for _, peer in counter.seen}) == 1, "one TCP connection carried every stream"
    assert counter.max_in_flight == STREAMS, (
        "the streams were multiplexed, not queued one after another"
    )
