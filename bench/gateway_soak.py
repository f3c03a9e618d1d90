"""`flashstack serve` under mixed and hostile traffic, RSS and fds: docs/benchmarks.md, "Soak"."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MASTER_KEY = "sk-soak-master-7f3e91c2"
UPSTREAM_KEY = "sk-soak-upstream-b41d08e6"  # what the gateway sends upstream; must never come back
HOSTILE_KEY = "sk-soak-hostile-2a9c5f17"
SECRETS = (MASTER_KEY, UPSTREAM_KEY, HOSTILE_KEY)
MiB = 1024 * 1024
# Server limits as `flashstack serve` defaults them (flashstack/config.py ServerConfig): the slow
# clients below are paced against these.
HEADER_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE = 10.0, 30.0, 15.0
MAX_BODY = 32 * MiB
DRAIN_SECONDS = KEEP_ALIVE + 10  # idle keep-alive connections closed, lingering closes done
_DISCOVERY_ENV = (
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "OLLAMA_HOST",
)


# ---- processes
# ------------------------------------------------------------------------------------


def serve_upstreams() -> None:
    """Child mode: start the three fakes, print their URLs as one JSON line, serve until stdin
    closes."""
    from tests.fakes import anthropic_upstream, hostile_upstream, openai_upstream
    from tests.fakes.server import FakeServer

    servers = {
        "openai": FakeServer(openai_upstream.create_app(api_key=UPSTREAM_KEY)).start(),
        "anthropic": FakeServer(anthropic_upstream.create_app(api_key=UPSTREAM_KEY)).start(),
        "hostile": FakeServer(hostile_upstream.create_app()).start(),
    }
    print(json.dumps({k: s.url for k, s in servers.items()}), flush=True)
    sys.stdin.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config_yaml(urls: dict[str, str]) -> str:
    # Breakers never open and nothing is retried, so that every hostile request reaches the hostile
    # upstream (an open breaker would answer 503 without touching the code under test).
    return json.dumps(
        {
            "auth": {"master_key": MASTER_KEY},
            "compression": {"mode": "off"},
            "router": {"num_retries": 0, "breaker_failures": 10**6, "breaker_min_requests": 10**6},
            "models": [
                {
                    "name": "gpt",
                    "provider": "openai",
                    "model": "gpt-4o-mini",
                    "api_base": urls["openai"] + "/v1",
                    "api_key": UPSTREAM_KEY,
                },
                {
                    "name": "claude",
                    "provider": "anthropic",
                    "model": "claude-sonnet-4-5-20250929",
                    "api_base": urls["anthropic"],
                    "api_key": UPSTREAM_KEY,
                },
                {
                    "name": "hostile-oai",
                    "provider": "openai",
                    "model": "m",
                    "api_base": urls["hostile"] + "/v1",
                    "api_key": HOSTILE_KEY,
                },
                {
                    "name": "hostile-ant",
                    "provider": "anthropic",
                    "model": "m",
                    "api_base": urls["hostile"],
                    "api_key": HOSTILE_KEY,
                },
            ],
        }
    )  # JSON is YAML


@dataclass
class Processes:
    upstreams: subprocess.Popen
    gateway: subprocess.Popen
    url: str
    upstream_names: dict[int, str]  # port → which fake

    @property
    def upstream_ports(self) -> list[int]:
        return list(self.upstream_names)

    def stop(self) -> None:
        self.gateway.terminate()
        try:
            self.gateway.wait(15)
        except subprocess.TimeoutExpired:
            self.gateway.kill()
        self.upstreams.stdin.close()
        self.upstreams.terminate()
        self.upstreams.wait(15)


def start(workdir: Path) -> Processes:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _DISCOVERY_ENV and not k.startswith("FLASHSTACK_")
    }
    env["PYTHONPATH"] = str(ROOT)
    upstreams = subprocess.Popen(
        [sys.executable, __file__, "--serve-upstreams"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    urls = json.loads(upstreams.stdout.readline())
    (workdir / "flashstack.yaml").write_text(_config_yaml(urls))
    port = _free_port()
    log = open(workdir / "gateway.log", "w")
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flashstack.cli",
            "serve",
            "--config",
            "flashstack.yaml",
            "--port",
            str(port),
        ],
        cwd=workdir,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if gateway.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"flashstack serve did not start: {(workdir / 'gateway.log').read_text()[-2000:]}"
            )
        try:
            if httpx.get(url + "/health/liveness", timeout=0.5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    names = {int(u.rsplit(":", 1)[1]): name for name, u in urls.items()}
    return Processes(upstreams, gateway, url, names)


# ---- outcomes
# -------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Every request's outcome, the normal ones' latencies, and what went wrong, with examples."""

    outcomes: collections.Counter = field(default_factory=collections.Counter)
    latency: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    normal_total: int = 0
    normal_failed: int = 0
    unexpected: collections.Counter = field(default_factory=collections.Counter)
    examples: dict[str, str] = field(default_factory=dict)

    def record(self, kind: str, status: object, ok: bool, detail: str = "") -> None:
        self.outcomes[f"{kind} {status}"] += 1
        if not ok:
            self.unexpected[f"{kind} {status}"] += 1
            self.examples.setdefault(f"{kind} {status}", detail[:400])

    def normal(self, kind: str, status: object, ok: bool, seconds: float, detail: str = "") -> None:
        self.normal_total += 1
        self.record(kind, status, ok, detail)
        if ok:
            self.latency[kind].append(seconds)
        else:
            self.normal_failed += 1


def _leaks(text: str, ports: list[int]) -> str | None:
    """What of the gateway's secrets or upstream addresses `text` contains, if anything."""
    for secret in SECRETS:
        if secret in text:
            return f"secret {secret[:10]}…"
    for port in ports:
        if f":{port}" in text:
            return f"upstream port {port}"
    return None


# ---- normal traffic
# -------------------------------------------------------------------------------


@dataclass
class Soak:
    url: str
    key: str
    ports: list[int]
    client: httpx.AsyncClient
    tally: Tally = field(default_factory=Tally)
    session_id: str | None = None
    session_turns: int = 0
    stop_at: float = 0.0

    def openai_headers(self, key: str | None = None) -> dict[str, str]:
        return {"authorization": f"Bearer {key or self.key}"}

    def anthropic_headers(self, key: str | None = None) -> dict[str, str]:
        return {"x-api-key": key or self.key, "anthropic-version": "2023-06-01"}


def _openai_body(model: str, text: str, stream: bool) -> dict[str, Any]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": text}]}


def _anthropic_body(model: str, text: str, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "stream": stream,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": text}],
    }


def _stream_text(wire: str, raw: str) -> str:
    """The text deltas of an SSE body on `wire`."""
    out = []
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if wire == "openai":
            out += [c["delta"].get("content") or "" for c in event.get("choices", [])]
        elif event.get("type") == "content_block_delta":
            out.append(event["delta"].get("text", ""))
    return "".join(out)


def _reply_text(wire: str, body: dict[str, Any]) -> str:
    if wire == "openai":
        return body["choices"][0]["message"]["content"]
    return "".join(b.get("text", "") for b in body["content"])


async def normal_chat(
    soak: Soak, wire: str, model: str, stream: bool, session: bool = False
) -> None:
    """One chat request that must answer 200 with the fake's echo of its text."""
    text = f"soak {random.randrange(10**9)}"
    path, body, headers = (
        ("/v1/chat/completions", _openai_body(model, text, stream), soak.openai_headers())
        if wire == "openai"
        else ("/v1/messages", _anthropic_body(model, text, stream), soak.anthropic_headers())
    )
    kind = f"normal {wire}->{model}{' stream' if stream else ''}{' session' if session else ''}"
    if session:
        headers = {**headers, "x-session-id": await _session(soak)}
    t = time.monotonic()
    try:
        r = await soak.client.post(path, json=body, headers=headers)
        got = (
            _stream_text(wire, r.text)
            if stream and r.status_code == 200
            else _reply_text(wire, r.json())
            if r.status_code == 200
            else None
        )
        ok = r.status_code == 200 and got is not None and got.endswith("echo: " + text)
        soak.tally.normal(kind, r.status_code, ok, time.monotonic() - t, r.text)
    except (httpx.HTTPError, ValueError, KeyError) as e:
        soak.tally.normal(kind, type(e).__name__, False, time.monotonic() - t, repr(e))


async def _session(soak: Soak) -> str:
    """The current session; a new one every 20 turns so that no history grows without end."""
    if soak.session_id is None or soak.session_turns >= 20:
        r = await soak.client.post(
            "/v1/sessions", json={"metadata": {"soak": "1"}}, headers=soak.openai_headers()
        )
        r.raise_for_status()
        soak.session_id, soak.session_turns = r.json()["id"], 0
    soak.session_turns += 1
    return soak.session_id


async def aborted_stream(soak: Soak, wire: str) -> None:
    """A stream of one chunk every 0.2 s, dropped by the client after its first chunks."""
    text = "[[slow:0.2]] abort me"
    path, body, headers = (
        ("/v1/chat/completions", _openai_body("gpt", text, True), soak.openai_headers())
        if wire == "openai"
        else ("/v1/messages", _anthropic_body("claude", text, True), soak.anthropic_headers())
    )
    kind = f"aborted stream {wire}"
    try:
        # its own connection, closed mid-stream
        async with httpx.AsyncClient(base_url=soak.url, timeout=20) as c:
            async with c.stream("POST", path, json=body, headers=headers) as r:
                seen = 0
                async for _ in r.aiter_bytes():
                    seen += 1
                    if seen >= 2:
                        break
        soak.tally.record(kind, r.status_code, r.status_code == 200)
    except httpx.HTTPError as e:
        soak.tally.record(kind, type(e).__name__, False, repr(e))


# ---- hostile upstream
# -----------------------------------------------------------------------------

# mode → the statuses docs/security.md ("Upstream limits") promises for it. An upstream 500 keeps
# its status (with a redacted excerpt); a failure after a stream's first token is an error event in
# a 200.
HOSTILE_MODES = {
    "echo_401": (502,),
    "echo_403": (502,),
    "echo_500": (500,),
    "big_body:24000000": (502,),
    "big_declared:20000000": (502,),
    "big_error:8000000": (500,),
    "giant_line:3000000": (502,),
    "giant_event:3000000": (502,),
    "empty_json": (502,),
    "wrong_shape": (502,),
    "late_echo": (200, 502),
    "late_giant_line:3000000": (200, 502),
    "normal": (200,),
}


async def hostile_request(soak: Soak) -> None:
    """A request the hostile upstream answers badly: never a 500, a credential or an upstream
    address."""
    wire = random.choice(["openai", "anthropic"])
    model = random.choice(["hostile-oai", "hostile-ant"])
    mode, stream = random.choice(list(HOSTILE_MODES)), random.random() < 0.5
    text = f"[[hostile:{mode}]] please" if mode != "normal" else "plain"
    path, body, headers = (
        ("/v1/chat/completions", _openai_body(model, text, stream), soak.openai_headers())
        if wire == "openai"
        else ("/v1/messages", _anthropic_body(model, text, stream), soak.anthropic_headers())
    )
    kind = f"hostile {mode.split(':')[0]}{' stream' if stream else ''}"
    try:
        r = await soak.client.post(path, json=body, headers=headers, timeout=60)
        leak = _leaks(r.text + str(dict(r.headers)), soak.ports)
        ok = r.status_code in HOSTILE_MODES[mode] and not leak
        soak.tally.record(kind, r.status_code, ok, leak or r.text)
        if leak:
            soak.tally.outcomes["LEAK"] += 1
    except httpx.HTTPError as e:
        soak.tally.record(kind, type(e).__name__, False, repr(e))


# ---- hostile clients (raw sockets)
# ----------------------------------------------------------------


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


async def _read_reply(reader: asyncio.StreamReader, timeout: float) -> tuple[int | str, bytes]:
    """The status of what the server sends before it closes (or 'timeout' / 'closed' / 'reset')."""
    data = b""
    try:
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                data += chunk
    except TimeoutError:
        return "timeout", data
    except ConnectionResetError:
        if not data:
            return "reset", data
    if not data:
        return "closed", data
    try:
        return int(data.split(b" ", 2)[1]), data
    except (IndexError, ValueError):
        return "garbled", data


def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except (ConnectionError, RuntimeError):
        pass


def _status_ok(status: object, want: tuple[object, ...], body: bytes, soak: Soak) -> bool:
    return status in want and not _leaks(body.decode("latin-1"), soak.ports)


async def slowloris(soak: Soak) -> None:
    """A request line, then one header byte every 2 s: refused 408 at the header deadline."""
    reader, writer = await asyncio.open_connection(*_host_port(soak.url))
    t = time.monotonic()
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        await writer.drain()
        while time.monotonic() - t < HEADER_TIMEOUT * 3:
            read = asyncio.ensure_future(reader.read(65536))
            done, _ = await asyncio.wait([read], timeout=2.0)
            if done:
                first = read.result()
                status, rest = await _read_reply(reader, 5)
                data = first + rest
                code = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else "closed"
                soak.tally.record(
                    "slowloris",
                    code,
                    _status_ok(code, (408,), data, soak),
                    data[:200].decode("latin-1"),
                )
                return
            read.cancel()
            writer.write(b"a")
            await writer.drain()
        soak.tally.record("slowloris", "held open", False, f"{time.monotonic() - t:.0f} s")
    except (ConnectionError, OSError) as e:
        soak.tally.record("slowloris", type(e).__name__, False, repr(e))
    finally:
        _close(writer)


async def idle_connection(soak: Soak) -> None:
    """Connect and send nothing: the server closes it at the header deadline."""
    reader, writer = await asyncio.open_connection(*_host_port(soak.url))
    try:
        status, data = await _read_reply(reader, HEADER_TIMEOUT * 3)
        soak.tally.record(
            "idle before request",
            status,
            _status_ok(status, (408, "closed"), data, soak),
            data[:200].decode("latin-1"),
        )
    finally:
        _close(writer)


async def idle_keep_alive(soak: Soak) -> None:
    """One request, then silence: the server closes the connection at the keep-alive timeout."""
    reader, writer = await asyncio.open_connection(*_host_port(soak.url))
    try:
        writer.write(b"GET /health/liveness HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(
            next(
                v
                for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
                if k.lower() == b"content-length"
            )
        )
        await reader.readexactly(length)
        t = time.monotonic()
        status, data = await _read_reply(reader, KEEP_ALIVE * 3)
        held = time.monotonic() - t
        ok = status == "closed" and held < KEEP_ALIVE + 5
        soak.tally.record("idle after request", status, ok, f"held {held:.1f} s")
    except (
        ConnectionError,
        OSError,
        asyncio.IncompleteReadError,
        TimeoutError,
        StopIteration,
    ) as e:
        soak.tally.record("idle after request", type(e).__name__, False, repr(e))
    finally:
        _close(writer)


def _chunked_head(soak: Soak) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
        b"application/json\r\n"
        b"Authorization: Bearer " + soak.key.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def slow_body(soak: Soak) -> None:
    """A chunked body that never ends, 20 bytes a second: refused 408 when a window brings too
    little."""
    reader, writer = await asyncio.open_connection(*_host_port(soak.url))
    t = time.monotonic()
    try:
        writer.write(
            _chunked_head(soak)
            + _chunk(b'{"model": "gpt", "messages": [{"role": "user", "content": "')
        )
        await writer.drain()
        while time.monotonic() - t < BODY_TIMEOUT * 3:
            read = asyncio.ensure_future(reader.read(65536))
            done, _ = await asyncio.wait([read], timeout=1.0)
            if done:
                first = read.result()
                _, rest = await _read_reply(reader, 5)
                data = first + rest
                code = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else "closed"
                soak.tally.record(
                    "never-ending body, slow",
                    code,
                    _status_ok(code, (408,), data, soak),
                    data[:200].decode("latin-1"),
                )
                return
            read.cancel()
            writer.write(_chunk(b"x" * 20))
            await writer.drain()
        soak.tally.record(
            "never-ending body, slow", "held open", False, f"{time.monotonic() - t:.0f} s"
        )
    except (ConnectionError, OSError) as e:
        soak.tally.record("never-ending body, slow", type(e).__name__, False, repr(e))
    finally:
        _close(writer)


async def fast_body(soak: Soak) -> None:
    """A chunked body that never ends, at 32 MiB/s: refused 413 past max_body_bytes.

    Paced like a fast network rather than loopback: a client that keeps writing megabytes past the
    reply, faster than it reads, gets a reset once the server's lingering close gives up (1 MiB, 2
    s).
    """
    reader, writer = await asyncio.open_connection(*_host_port(soak.url))
    piece = _chunk(b"x" * 65536)
    sent = 0
    try:
        writer.write(_chunked_head(soak))
        read = asyncio.ensure_future(reader.read(65536))
        while sent < MAX_BODY * 4 and not read.done():
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.002)
            sent += 65536
        first = await asyncio.wait_for(read, 10)
        _, rest = await _read_reply(reader, 5)
        data = first + rest
        code = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else "closed"
        soak.tally.record(
            "never-ending body, fast",
            code,
            _status_ok(code, (413,), data, soak) and sent < MAX_BODY * 2,
            f"sent {sent / MiB:.0f} MiB " + data[:200].decode("latin-1"),
        )
    except (ConnectionError, OSError, TimeoutError) as e:
        soak.tally.record(
            "never-ending body, fast", type(e).__name__, False, f"sent {sent / MiB:.0f} MiB {e!r}"
        )
    finally:
        _close(writer)


async def malformed_body(soak: Soak) -> None:
    """A chunk longer than its declared size, after authenticated headers: 400 in JSON, then
    closed."""
    reader, writer = await asyncio.open_connection(*_host_port(soak.url))
    try:
        writer.write(_chunked_head(soak) + b'4\r\n{"model": "gpt"}\r\n0\r\n\r\n')
        await writer.drain()
        status, data = await _read_reply(reader, 10)
    except (ConnectionError, OSError) as e:
        status, data = type(e).__name__, b""
    finally:
        _close(writer)
    ok = _status_ok(status, (400,), data, soak) and b'"error"' in data
    soak.tally.record("malformed chunked body", status, ok, data[:300].decode("latin-1"))


async def oversized_header(soak: Soak) -> None:
    """A 100 KiB header value, unauthenticated: 431 in the wire's JSON."""
    reader, writer = await asyncio.open_connection(*_host_port(soak.url))
    try:
        writer.write(
            b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
            + b"b" * (100 * 1024)
            + b"\r\n\r\n"
        )
        await writer.drain()
        status, data = await _read_reply(reader, 10)
    except (ConnectionError, OSError) as e:
        status, data = type(e).__name__, b""
    finally:
        _close(writer)
    ok = _status_ok(status, (431,), data, soak) and b'"type":"error"' in data.replace(b" ", b"")
    soak.tally.record("oversized header", status, ok, data[:300].decode("latin-1"))


async def bad_key(soak: Soak) -> None:
    """A wrong key on either wire, or none on /metrics: 401."""
    choice = random.randrange(3)
    if choice == 0:
        r = await soak.client.post(
            "/v1/chat/completions",
            json=_openai_body("gpt", "hi", False),
            headers=soak.openai_headers("sk-not-a-key"),
        )
        ok = r.status_code == 401 and "error" in r.json()
    elif choice == 1:
        r = await soak.client.post(
            "/v1/messages",
            json=_anthropic_body("claude", "hi", False),
            headers=soak.anthropic_headers("sk-not-a-key"),
        )
        ok = r.status_code == 401 and r.json().get("type") == "error"
    else:
        r = await soak.client.get("/metrics")
        ok = r.status_code == 401
    soak.tally.record(
        ["bad key openai", "bad key anthropic", "no key /metrics"][choice],
        r.status_code,
        ok,
        r.text,
    )


# ---- the load
# -------------------------------------------------------------------------------------

# name: (weight, scenario) for the scheduled requests; slow clients have lanes of their own (LANES).
SCHEDULE: dict[str, tuple[float, Callable[[Soak], Awaitable[None]]]] = {
    "openai": (10, lambda s: normal_chat(s, "openai", "gpt", False)),
    "openai-stream": (10, lambda s: normal_chat(s, "openai", "gpt", True)),
    "anthropic": (10, lambda s: normal_chat(s, "anthropic", "claude", False)),
    "anthropic-stream": (10, lambda s: normal_chat(s, "anthropic", "claude", True)),
    "openai-to-anthropic": (4, lambda s: normal_chat(s, "openai", "claude", True)),
    "anthropic-to-openai": (4, lambda s: normal_chat(s, "anthropic", "gpt", True)),
    "session": (3, lambda s: normal_chat(s, "openai", "gpt", False, session=True)),
    "hostile-upstream": (6, hostile_request),
    "aborted-stream": (3, lambda s: aborted_stream(s, random.choice(["openai", "anthropic"]))),
    "bad-key": (3, bad_key),
    "oversized-header": (2, oversized_header),
    "malformed-body": (2, malformed_body),
    "fast-body": (0.3, fast_body),
}
LANES: dict[str, tuple[int, Callable[[Soak], Awaitable[None]]]] = {
    "slowloris": (3, slowloris),
    "idle": (3, idle_connection),
    "idle-keep-alive": (2, idle_keep_alive),
    "slow-body": (2, slow_body),
}


async def _lane(soak: Soak, scenario: Callable[[Soak], Awaitable[None]]) -> None:
    await asyncio.sleep(random.uniform(0, 5))  # stagger the lanes
    while time.monotonic() < soak.stop_at:
        try:
            await scenario(soak)
        except Exception as e:  # noqa: BLE001 - a failed attempt is an outcome, not the end of the soak
            soak.tally.record(scenario.__name__, type(e).__name__, False, repr(e))
            await asyncio.sleep(1)


async def _scheduled(soak: Soak, rate: float, names: list[str]) -> None:
    if not names:
        return
    weights = [SCHEDULE[n][0] for n in names]
    running: set[asyncio.Task] = set()
    while time.monotonic() < soak.stop_at:
        scenario = SCHEDULE[random.choices(names, weights)[0]][1]
        task = asyncio.create_task(_guarded(soak, scenario))
        running.add(task)
        task.add_done_callback(running.discard)
        await asyncio.sleep(random.expovariate(rate))
    await asyncio.gather(*running)


async def _guarded(soak: Soak, scenario: Callable[[Soak], Awaitable[None]]) -> None:
    try:
        await scenario(soak)
    except Exception as e:  # noqa: BLE001
        soak.tally.record(
            getattr(scenario, "__name__", "scenario"), type(e).__name__, False, repr(e)
        )


@dataclass
class Sample:
    t: float
    rss: int
    fds: int
    connections: int
    cpu: float  # the gateway's user + system seconds so far


def _sample(proc: psutil.Process, start: float) -> Sample:
    return Sample(
        time.monotonic() - start,
        proc.memory_info().rss,
        proc.num_fds(),
        len(proc.net_connections("tcp")),
        sum(proc.cpu_times()[:2]),
    )


def _descriptors(proc: psutil.Process, upstreams: dict[int, str]) -> collections.Counter:
    """What the gateway's descriptors are: files by path, TCP connections by peer and state."""
    held = collections.Counter(f.path for f in proc.open_files())
    for c in proc.net_connections("tcp"):
        peer = upstreams.get(c.raddr.port, "client") if c.raddr else "listening"
        held[f"tcp {peer} {c.status}"] += 1
    return held


async def _sampler(
    proc: psutil.Process, every: float, samples: list[Sample], start: float, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        samples.append(_sample(proc, start))
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


async def drive(
    procs: Processes, minutes: float, rate: float, every: float, only: set[str] | None
) -> dict[str, Any]:
    proc = psutil.Process(procs.gateway.pid)
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=8, keepalive_expiry=4)
    async with httpx.AsyncClient(base_url=procs.url, timeout=30, limits=limits) as client:
        r = await client.post(
            "/v1/keys", json={"name": "soak"}, headers={"authorization": f"Bearer {MASTER_KEY}"}
        )
        r.raise_for_status()
        soak = Soak(procs.url, r.json()["key"], procs.upstream_ports, client)
        warm = Soak(procs.url, soak.key, soak.ports, client, stop_at=time.monotonic() + 20)
        scheduled = [n for n in SCHEDULE if not only or n in only]
        lanes = {n: v for n, v in LANES.items() if not only or n in only}
        # imports, pools and caches filled before the baseline
        await _scheduled(warm, rate, scheduled)
        await asyncio.sleep(DRAIN_SECONDS)
        base = _sample(proc, time.monotonic())
        base_held = _descriptors(proc, procs.upstream_names)
        samples: list[Sample] = []
        stop = asyncio.Event()
        start = time.monotonic()
        sampler = asyncio.create_task(_sampler(proc, every, samples, start, stop))
        soak.stop_at = start + minutes * 60
        await asyncio.gather(
            _scheduled(soak, rate, scheduled),
            *(_lane(soak, s) for n, s in lanes.values() for _ in range(n)),
        )
        loaded = time.monotonic() - start
        stop.set()  # the trend covers the load; the drain is judged by the sample after it
        await sampler
        await asyncio.sleep(DRAIN_SECONDS)
        end = _sample(proc, start)
        end_held = _descriptors(proc, procs.upstream_names)
        after = await client.post(
            "/v1/chat/completions",
            json=_openai_body("gpt", "after", False),
            headers=soak.openai_headers(),
        )
    upstream_cpu = sum(psutil.Process(procs.upstreams.pid).cpu_times()[:2])
    result = report(soak.tally, samples, base, end, loaded, minutes, rate, after.status_code)
    result["upstreams_cpu_s"] = round(upstream_cpu, 1)
    # what the idle gateway holds that it did not
    result["fds"]["added_after"] = dict(end_held - base_held)
    result["fds"]["gone_after"] = dict(base_held - end_held)
    return {
        "scheduled": {n: SCHEDULE[n][0] for n in scheduled},
        "lanes": {n: v[0] for n, v in lanes.items()},
        **result,
    }


# ---- the report
# -----------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _trend(samples: list[Sample], attr: str, window: float) -> dict[str, float]:
    end = samples[-1].t
    first = [getattr(s, attr) for s in samples if s.t <= window]
    last = [getattr(s, attr) for s in samples if s.t >= end - window]
    return {
        "first_window_median": statistics.median(first),
        "last_window_median": statistics.median(last),
        "first_window_max": max(first),
        "last_window_max": max(last),
    }


def report(
    tally: Tally,
    samples: list[Sample],
    base: Sample,
    end: Sample,
    loaded: float,
    minutes: float,
    rate: float,
    after_status: int,
) -> dict[str, Any]:
    window = min(300.0, minutes * 60 / 4)
    rss, fds = _trend(samples, "rss", window), _trend(samples, "fds", window)
    latencies = [x for v in tally.latency.values() for x in v]
    per_minute = [
        next(s for s in samples if s.t >= m * 60) for m in range(int(samples[-1].t // 60) + 1)
    ]
    # Thresholds fixed before the first run: memory may grow within the first window as pools and
    # caches fill, not after it; descriptors must come back to the idle baseline once clients are
    # gone.
    rss_ok = rss["last_window_max"] <= rss["first_window_max"] * 1.10 + 8 * MiB
    fds_ok = end.fds <= base.fds + 4 and fds["last_window_max"] <= fds["first_window_max"] + 16
    checks = {
        "normal_errors_zero": tally.normal_failed == 0,
        "no_unexpected_outcomes": not tally.unexpected,
        "no_leaked_secret": tally.outcomes["LEAK"] == 0,
        "rss_bounded": rss_ok,
        "fds_back_to_baseline": fds_ok,
        "serves_after": after_status == 200,
    }
    mib = lambda d: {k: round(v / MiB, 1) for k, v in d.items()}  # noqa: E731
    return {
        "duration_s": round(loaded, 1),
        "rate_per_s": rate,
        "requests": sum(tally.outcomes.values()) - tally.outcomes["LEAK"],
        "outcomes": dict(sorted(tally.outcomes.items())),
        "unexpected": dict(tally.unexpected),
        "unexpected_examples": tally.examples,
        "normal": {
            "requests": tally.normal_total,
            "failed": tally.normal_failed,
            "error_rate": tally.normal_failed / max(1, tally.normal_total),
            "latency_ms": {
                "p50": round(_percentile(latencies, 0.5) * 1000, 1),
                "p99": round(_percentile(latencies, 0.99) * 1000, 1),
            }
            if latencies
            else None,
            "p50_ms_by_kind": {
                k: round(statistics.median(v) * 1000, 1) for k, v in sorted(tally.latency.items())
            },
        },
        "gateway_cpu_s": round(samples[-1].cpu - base.cpu, 1),
        "gateway_cpu_s_per_minute": [
            round(b.cpu - a.cpu, 1) for a, b in zip(per_minute, per_minute[1:])
        ],
        "rss_mib_per_minute": [round(s.rss / MiB, 1) for s in per_minute],
        "rss_mib": {
            **mib(_stats([s.rss for s in samples])),
            **mib(rss),
            "idle_before": round(base.rss / MiB, 1),
            "idle_after": round(end.rss / MiB, 1),
        },
        "fds": {
            **_stats([s.fds for s in samples]),
            **fds,
            "idle_before": base.fds,
            "idle_after": end.fds,
        },
        "tcp_connections": {
            **_stats([s.connections for s in samples]),
            "idle_before": base.connections,
            "idle_after": end.connections,
        },
        "samples": len(samples),
        "trend_window_s": window,
        "checks": checks,
        "verdict": "PASS" if all(checks.values()) else "FAIL",
        "machine": {"cpus": os.cpu_count(), "load_average_end": os.getloadavg()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument(
        "--rate",
        type=float,
        default=3.0,
        help="scheduled requests per second (slow-client lanes come on top)",
    )
    parser.add_argument("--sample", type=float, default=5.0, help="seconds between RSS/fd samples")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument(
        "--only", help=f"comma-separated scenarios (default: all): {', '.join([*SCHEDULE, *LANES])}"
    )
    parser.add_argument("--serve-upstreams", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstreams:
        return serve_upstreams()
    with tempfile.TemporaryDirectory(prefix="flashstack-soak-") as workdir:
        procs = start(Path(workdir))
        try:
            only = set(args.only.split(",")) if args.only else None
            result = asyncio.run(drive(procs, args.minutes, args.rate, args.sample, only))
            lines = collections.Counter((Path(workdir) / "gateway.log").read_text().splitlines())
            result["gateway_log"] = dict(lines.most_common(12))
        finally:
            procs.stop()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    sys.exit(0 if result["verdict"] == "PASS" else 1)


if __name__ == "__main__":
    main()
