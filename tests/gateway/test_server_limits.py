"""Hostile clients against a real gateway (uvicorn, the protocol class `flashstack serve` uses).

Each attack is refused with its status in the caller's wire format, memory stays bounded, and a
normal request succeeds right after. Limits are small here so that each test takes well under 2 s.
"""

from __future__ import annotations

import gzip
import resource
import select
import socket
import subprocess
import sys
import time
import zlib

import httpx
import psutil
import pytest

from flashstack.gateway.app import create_app
from flashstack.gateway.browser_guard import BrowserGuard
from flashstack.gateway.config import AuthConfig, Config
from flashstack.gateway.server_limits import uvicorn_options
from tests.fakes.server import FakeServer
from tests.gateway.conftest import gateway_config

LIMITS = dict(
    max_body_bytes=256 * 1024,
    max_header_bytes=16 * 1024,
    header_timeout=0.5,
    body_timeout=0.4,
    body_min_rate=2000,
    keep_alive_timeout=0.5,
)
OK_OPENAI = b'{"model": "gpt", "messages": [{"role": "user", "content": "hi"}]}'
MiB = 1024 * 1024


def start_gateway(config: Config) -> FakeServer:
    return FakeServer(
        create_app(config), lifespan="on", loop="uvloop", **uvicorn_options(config.server)
    ).start()


@pytest.fixture(scope="module")
def gateway(upstreams):
    server = start_gateway(gateway_config(upstreams, **LIMITS))
    yield server
    server.stop()


@pytest.fixture
def still_serves(gateway):
    """After the test: a normal chat request on a fresh connection gets its answer."""
    yield
    with httpx.Client(base_url=gateway.url, timeout=5) as c:
        r = c.post(
            "/v1/chat/completions", content=OK_OPENAI, headers={"content-type": "application/json"}
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "echo: hi"


# ---- raw HTTP over a socket ---------------------------------------------------------------------


def connect(server: FakeServer) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_all(s: socket.socket, timeout: float = 5) -> bytes:
    """Everything until the server closes (a reset after the reply counts as the close)."""
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def send_until_answered(
    s: socket.socket, head: bytes, filler: bytes, total: int, polite: bool = True
) -> int:
    """Send `head`, then `filler` over and over up to `total` bytes; a polite client
    stops at the reply.

    Returns the bytes sent before the reply arrived, or (impolite) before the server
    stopped reading.
    """
    s.sendall(head)
    sent = len(head)
    s.setblocking(False)  # send() takes what fits; select() says when more will
    try:
        while sent < total:
            readable, writable, _ = select.select([s] if polite else [], [s], [], 5)
            if readable or not writable:
                break
            sent += s.send(filler)
    except (BrokenPipeError, ConnectionResetError, BlockingIOError):
        pass
    s.setblocking(True)
    return sent


def trickle(s: socket.socket, byte: bytes, interval: float, seconds: float) -> None:
    """Send `byte` every `interval` seconds until a reply is readable (or `seconds` have passed)."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and not select.select([s], [], [], interval)[0]:
            s.sendall(byte)
    except (BrokenPipeError, ConnectionResetError):
        pass


class Reply:
    """A parsed HTTP/1.1 reply with a JSON body."""

    def __init__(self, raw: bytes) -> None:
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1]) if lines[0] else 0
        self.headers = {
            k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
        }

    def openai_error(self, needle: str) -> dict:
        assert self.headers["content-type"] == "application/json"
        err = httpx.Response(self.status, content=self.body).json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and needle in err["message"], err
        return err

    def anthropic_error(self, needle: str) -> dict:
        assert self.headers["content-type"] == "application/json"
        body = httpx.Response(self.status, content=self.body).json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert needle in body["error"]["message"], body
        return body["error"]


def rss() -> int:
    return psutil.Process().memory_info().rss  # the gateway runs in this process, in a thread


# ---- header size ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_huge_header_is_refused_early_with_bounded_memory(gateway, still_serves, path):
    filler = b"a" * 65536
    before = rss()
    with connect(gateway) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ".encode()
        # An attacker ignores the reply and keeps sending: the server discards a
        # little, then hangs up.
        sent = send_until_answered(s, head, filler, 64 * MiB, polite=False)
        reply = Reply(read_all(s))
    grown = rss() - before
    assert reply.status == 431 and reply.headers["connection"] == "close"
    err = reply.anthropic_error if path == "/v1/messages" else reply.openai_error
    err("server.max_header_bytes")
    # What got into the kernel's socket buffers before the reset; never the whole header.
    assert MiB // 2 < sent < 48 * MiB, f"the server read {sent / MiB:.1f} MiB"
    # Unbounded, the parser would hold every byte of the value (and uvicorn a copy).
    assert grown < 2 * MiB, f"RSS grew {grown / MiB:.1f} MiB for a {sent / MiB:.0f} MiB header"


def test_many_headers_count_towards_the_limit(gateway, still_serves):
    # 40 KB of small ones
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(400))
    with connect(gateway) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + b"\r\n")
        Reply(read_all(s)).openai_error("16384 bytes")


def test_oversized_second_request_on_a_keep_alive_connection_gets_431(gateway, still_serves):
    with connect(gateway) as s:
        s.sendall(b"GET /health/liveness HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.sendall(
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n"
        )
        reply = Reply(read_all(s))
    assert reply.status == 431
    reply.openai_error("server.max_header_bytes")


def test_headers_under_the_limit_pass(gateway):
    with httpx.Client(base_url=gateway.url, timeout=5) as c:
        r = c.post(
            "/v1/chat/completions",
            content=OK_OPENAI,
            headers={"content-type": "application/json", "x-pad": "p" * 12_000},
        )
    assert r.status_code == 200, r.text


# ---- timeouts -------------------------------------------------------------------------------


def test_slowloris_headers_get_408(gateway, still_serves):
    t0 = time.monotonic()
    with connect(gateway) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        trickle(s, b"X", 0.1, 3)  # a header byte every 0.1 s: each well within any idle timeout
        reply = Reply(read_all(s))
    assert reply.status == 408
    reply.openai_error("server.header_timeout")
    assert time.monotonic() - t0 < 2.0


def test_idle_connection_is_closed_without_a_reply(gateway, still_serves):
    t0 = time.monotonic()
    with connect(gateway) as s:
        assert read_all(s) == b""
    assert 0.4 < time.monotonic() - t0 < 2.0


def test_keep_alive_connection_is_closed_after_its_idle_timeout(gateway, still_serves):
    with connect(gateway) as s:
        s.sendall(b"GET /health/liveness HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        s.settimeout(5)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert read_all(s) == b""
    assert time.monotonic() - t0 < 2.0


def test_slow_body_gets_408(gateway, still_serves):
    t0 = time.monotonic()
    with connect(gateway) as s:
        s.sendall(
            b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )
        trickle(s, b" ", 0.1, 3)  # 10 bytes/s, under body_min_rate
        reply = Reply(read_all(s))
    assert reply.status == 408
    reply.anthropic_error("server.body_min_rate")
    assert time.monotonic() - t0 < 2.0


def test_never_ending_slow_chunked_body_gets_408(gateway, still_serves):
    with connect(gateway) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        trickle(s, b"1\r\n \r\n", 0.1, 3)
        reply = Reply(read_all(s))
    assert reply.status == 408
    reply.openai_error("request body arrived slower")


def test_never_ending_fast_chunked_body_gets_413_and_the_connection_closes(gateway, still_serves):
    chunk = b"%x\r\n%s\r\n" % (16384, b" " * 16384)
    before = rss()
    with connect(gateway) as s:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        sent = send_until_answered(s, head, chunk, 32 * MiB)
        reply = Reply(read_all(s))
    assert reply.status == 413
    reply.openai_error("server.max_body_bytes")
    assert sent < 32 * MiB, "the server must stop the body, not read it to its end"
    assert rss() - before < 2 * MiB


# ---- connection cap -------------------------------------------------------------------------


@pytest.fixture
def capped(upstreams):
    server = start_gateway(gateway_config(upstreams, max_connections=4, header_timeout=3))
    yield server
    server.stop()


def test_connections_past_the_cap_get_503_then_nothing_and_fds_stay_bounded(capped):
    fds = psutil.Process().num_fds()
    idle = [connect(capped) for _ in range(4)]
    time.sleep(0.1)  # the server has accepted them
    with connect(capped) as s:
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}")
        reply = Reply(read_all(s))
    assert reply.status == 503 and reply.headers["retry-after"] == "1"
    reply.anthropic_error("server.max_connections")
    time.sleep(0.05)
    overflow = [connect(capped) for _ in range(64)]  # accepted, to be told 503 when they ask
    time.sleep(0.1)
    with connect(capped) as s:  # past the overflow: closed at once, without a reply
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_all(s, timeout=2) == b""
    for s in idle + overflow:
        s.close()
    time.sleep(0.2)
    with httpx.Client(base_url=capped.url, timeout=5) as c:
        assert c.get("/v1/models").status_code == 200
    assert psutil.Process().num_fds() - fds < 10


def test_a_low_descriptor_limit_shrinks_the_connection_cap_with_a_warning():
    # In a child process: it lowers its own hard RLIMIT_NOFILE, which cannot be raised again.
    code = """
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (600, 600))
from flashstack.gateway.config import ServerConfig
from flashstack.gateway.server_limits import uvicorn_options
limits = uvicorn_options(ServerConfig(max_connections=4096))["http"].limits
print(limits.max_connections, limits.overflow, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    cap, overflow, soft = map(int, out.stdout.split())
    assert cap + overflow == (600 - 256) // 2 and cap >= 7 * overflow > 0 and soft == 600
    assert "ulimit -n" in out.stderr and "server.max_connections" in out.stderr


def test_the_descriptor_limit_is_raised_to_what_the_cap_needs():
    code = """
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (300, 20000))
from flashstack.gateway.config import ServerConfig
from flashstack.gateway.server_limits import uvicorn_options
limits = uvicorn_options(ServerConfig(max_connections=1000))["http"].limits
print(limits.max_connections, limits.overflow, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""
    if (
        resource.getrlimit(resource.RLIMIT_NOFILE)[1] not in (resource.RLIM_INFINITY,)
        and resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 20000
    ):
        pytest.skip("this machine's hard descriptor limit is below 20000")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["1000", "125", str(256 + 2 * 1125)]


# ---- protocol errors and content encoding ---------------------------------------------------


PROTOCOL_ERRORS = [
    ("bad-content-length", b"Content-Length: abc\r\n\r\n"),
    ("negative-content-length", b"Content-Length: -5\r\n\r\n"),
    ("content-length-and-chunked", b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"),
    ("header-without-colon", b"Not a header\r\n\r\n"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
@pytest.mark.parametrize("name,rest", PROTOCOL_ERRORS, ids=[p[0] for p in PROTOCOL_ERRORS])
def test_protocol_errors_are_json_in_the_callers_format(gateway, still_serves, path, name, rest):
    with connect(gateway) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode() + rest)
        reply = Reply(read_all(s))
    assert reply.status == 400
    (reply.anthropic_error if path == "/v1/messages" else reply.openai_error)(
        "malformed HTTP request"
    )


def test_malformed_request_line_is_json(gateway, still_serves):
    with connect(gateway) as s:
        s.sendall(b"GARBAGE\x01 / WHAT\r\n\r\n")
        reply = Reply(read_all(s))
    assert reply.status == 400
    reply.openai_error("malformed HTTP request")


def _chat(gateway, body: bytes, **headers: str) -> httpx.Response:
    with httpx.Client(base_url=gateway.url, timeout=5) as c:
        return c.post(
            "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json", **headers},
        )


@pytest.mark.parametrize("encoding,compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_compressed_body_is_decoded(gateway, encoding, compress):
    r = _chat(gateway, compress(OK_OPENAI), **{"content-encoding": encoding})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "echo: hi"


def test_zip_bomb_is_refused_after_the_limit_with_bounded_memory(gateway, still_serves):
    bomb = gzip.compress(b"[" + b" " * (16 * MiB) + b"]", compresslevel=9)  # 16 MiB in ~16 KB
    before = rss()
    r = _chat(gateway, bomb, **{"content-encoding": "gzip"})
    assert r.status_code == 413, r.text
    assert "decodes (gzip) to more than" in r.json()["error"]["message"]
    assert rss() - before < 4 * MiB


@pytest.mark.parametrize("encoding", ["br", "zstd", "gzip, gzip"])
def test_unsupported_content_encoding_is_415_naming_the_header(gateway, encoding):
    r = _chat(gateway, OK_OPENAI, **{"content-encoding": encoding})
    assert r.status_code == 415
    err = r.json()["error"]
    assert "Content-Encoding" in err["message"] and err["param"] == "content-encoding"


def test_corrupt_gzip_is_400(gateway):
    r = _chat(gateway, gzip.compress(OK_OPENAI)[:-12], **{"content-encoding": "gzip"})
    assert r.status_code == 400
    assert "not valid gzip" in r.json()["error"]["message"]


# ---- browser requests with auth off (DNS rebinding, cross-site POSTs) ------------------------


def _post(gateway, path: str, body: bytes, **headers: str) -> httpx.Response:
    with httpx.Client(base_url=gateway.url, timeout=5) as c:
        return c.post(path, content=body, headers=headers)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8400", "127.0.0.1.nip.io"])
def test_foreign_host_is_refused_without_auth(gateway, still_serves, host):
    r = _post(
        gateway,
        "/v1/chat/completions",
        OK_OPENAI,
        host=host,
        **{"content-type": "application/json"},
    )
    assert r.status_code == 403 and "server.allowed_hosts" in r.json()["error"]["message"]
    r = _post(gateway, "/v1/messages", b"{}", host=host, **{"content-type": "application/json"})
    assert r.status_code == 403
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "permission_error"
    with httpx.Client(base_url=gateway.url, timeout=5, headers={"host": host}) as c:
        assert c.get("/v1/models").status_code == 403  # a rebound page could read the answer


@pytest.mark.parametrize(
    "host", ["localhost", "LOCALHOST.", "127.0.0.1", "[::1]:8400", "10.1.2.3:80", "app.localhost"]
)
def test_loopback_and_ip_hosts_are_served(gateway, host):
    r = _post(
        gateway,
        "/v1/chat/completions",
        OK_OPENAI,
        host=host,
        **{"content-type": "application/json"},
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://127.0.0.1:1"])
def test_cross_origin_request_is_refused_without_auth(gateway, still_serves, origin):
    r = _post(
        gateway,
        "/v1/chat/completions",
        OK_OPENAI,
        origin=origin,
        **{"content-type": "application/json"},
    )
    assert r.status_code == 403 and "server.allowed_origins" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "ctype",
    [
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ],
)
def test_browser_simple_content_types_are_refused(gateway, still_serves, ctype):
    r = _post(gateway, "/v1/messages", OK_OPENAI, **{"content-type": ctype})
    assert r.status_code == 415
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "application/json" in r.json()["error"]["message"]


def test_configured_hosts_and_origins_are_served(upstreams):
    config = gateway_config(
        upstreams, allowed_hosts=["*.corp.example"], allowed_origins=["https://ui.corp.example"]
    )
    server = start_gateway(config)
    try:
        r = _post(
            server,
            "/v1/chat/completions",
            OK_OPENAI,
            host="gw.corp.example",
            origin="https://ui.corp.example",
            **{"content-type": "application/json"},
        )
        assert r.status_code == 200, r.text
        same_origin = _post(
            server,
            "/v1/chat/completions",
            OK_OPENAI,
            host="gw.corp.example",
            origin="http://gw.corp.example",
            **{"content-type": "application/json"},
        )
        assert same_origin.status_code == 200
        assert (
            _post(
                server,
                "/v1/chat/completions",
                OK_OPENAI,
                host="gw.corp.example",
                origin="https://other.example",
                **{"content-type": "application/json"},
            ).status_code
            == 403
        )
    finally:
        server.stop()


def test_auth_on_leaves_host_and_origin_to_the_key_check():
    assert BrowserGuard.from_config(Config(auth=AuthConfig(master_key="sk-admin"))) is None
