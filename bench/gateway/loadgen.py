"""A lean HTTP/1.1 keep-alive load generator: raw asyncio protocol, one request in flight per
connection.

The same client measures the mock directly and through each gateway, so its own cost cancels out
of "gateway minus direct". Modes: sequential (concurrency 1), fixed concurrency (closed loop), and
open loop at a fixed rate, whose latencies count from the scheduled send time (no coordinated
omission).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Target:
    """One request, pre-rendered: where it goes and the bytes that ask for it."""

    host: str
    port: int
    raw: bytes
    marker: bytes = b"Hello"  # first-token text; its arrival is the time to first token

    @classmethod
    def post(cls, host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> Target:
        lines = [
            f"POST {path} HTTP/1.1",
            f"host: {host}:{port}",
            "content-type: application/json",
            f"content-length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        return cls(host, port, ("\r\n".join(lines) + "\r\n\r\n").encode() + body)


@dataclass(slots=True)
class Sample:
    ok: bool
    total: float  # seconds from send (or scheduled send) to the last body byte
    ttft: float  # seconds to the first-token marker (total when it never came)
    overhead_ms: float | None  # the gateway's own X-Flashstack-Overhead-Ms, when it sends one


class Conn(asyncio.Protocol):
    """One keep-alive connection; `request()` sends and resolves when the whole response is in."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Sample] | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed mid-response"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def request(self, target: Target, t0: float) -> asyncio.Future[Sample]:
        self.t0, self.marker, self.first = t0, target.marker, 0.0
        self.buf, self.body, self.head = bytearray(), bytearray(), None
        self.need, self.chunked, self.status, self.overhead = 0, False, 0, None
        self.waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(target.raw)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.buf += data
        if self.head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self._headers(bytes(self.buf[:end]).lower())
            del self.buf[: end + 4]
        self._chunks() if self.chunked else self._plain()
        if not self.first and self.marker in self.body:
            self.first = now
        if self.head == b"done":
            self._finish(now)

    def _headers(self, head: bytes) -> None:
        self.head = head
        self.status = int(head[9:12])
        self.chunked = b"transfer-encoding: chunked" in head
        self.need = int(header_value(head, b"content-length") or 0)
        own = header_value(head, b"x-flashstack-overhead-ms")
        self.overhead = float(own) if own else None

    def _plain(self) -> None:
        self.body += self.buf
        self.buf.clear()
        if len(self.body) >= self.need:
            self.head = b"done"

    def _chunks(self) -> None:
        while True:
            line = self.buf.find(b"\r\n")
            if line < 0:
                return
            size = int(self.buf[:line].split(b";")[0], 16)
            if len(self.buf) < line + 2 + size + 2:
                return
            self.body += self.buf[line + 2 : line + 2 + size]
            del self.buf[: line + 2 + size + 2]
            if size == 0:
                self.head = b"done"
                return

    def _finish(self, now: float) -> None:
        ok = 200 <= self.status < 300
        total = now - self.t0
        ttft = (self.first or now) - self.t0
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(Sample(ok, total, ttft, self.overhead))


def header_value(head: bytes, name: bytes) -> bytes | None:
    """The value of header `name` in a lower-cased header block, or None."""
    i = head.find(b"\r\n" + name + b":")
    if i < 0:
        return None
    start = i + len(name) + 3
    end = head.find(b"\r\n", start)
    return head[start : end if end >= 0 else len(head)].strip()


async def connect(target: Target) -> Conn:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(Conn, target.host, target.port)
    return conn


@dataclass
class Run:
    """The samples of one load phase and the wall time it took."""

    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    wall: float = 0.0

    def record(self, s: Sample) -> None:
        if s.ok:
            self.samples.append(s)
        else:
            self.errors += 1

    @property
    def rps(self) -> float:
        return len(self.samples) / self.wall if self.wall else 0.0


async def closed_loop(target: Target, concurrency: int, n: int, timeout: float = 60.0) -> Run:
    """`n` requests over `concurrency` connections, each sending its next request when one
    returns."""
    run, left = Run(), [n]

    async def worker() -> None:
        conn = await connect(target)
        while left[0] > 0:
            left[0] -= 1
            try:
                s = await asyncio.wait_for(conn.request(target, time.perf_counter()), timeout)
            except (ConnectionError, TimeoutError):
                run.errors += 1
                conn.close()
                conn = await connect(target)
                continue
            run.record(s)
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.wall = time.perf_counter() - t0
    return run


async def open_loop(
    target: Target, rate: float, duration: float, max_conns: int = 512, timeout: float = 10.0
) -> Run:
    """Requests sent at `rate`/s for `duration` s whatever the answers; latency from the scheduled
    time."""
    run, idle, busy = Run(), [], [0]
    pending: set[asyncio.Task] = set()
    loop = asyncio.get_running_loop()

    async def one(scheduled: float) -> None:
        if idle:
            conn = idle.pop()
        elif busy[0] >= max_conns:
            run.errors += 1  # the gateway is holding more requests than the generator may open
            return
        else:
            conn = await connect(target)
        busy[0] += 1
        try:
            s = await asyncio.wait_for(conn.request(target, scheduled), timeout)
            run.record(s)
            idle.append(conn)
        except (ConnectionError, TimeoutError):
            run.errors += 1
            conn.close()
        finally:
            busy[0] -= 1

    n = int(rate * duration)
    t0 = time.perf_counter()
    for i in range(n):
        scheduled = t0 + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = loop.create_task(one(scheduled))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.wait(pending)
    run.wall = time.perf_counter() - t0
    for conn in idle:
        conn.close()
    return run


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summary(run: Run) -> dict[str, float]:
    """p50/p99 of total and time-to-first-token in ms, throughput, errors."""
    total = [s.total * 1000 for s in run.samples]
    ttft = [s.ttft * 1000 for s in run.samples]
    out = {
        "n": len(run.samples),
        "errors": run.errors,
        "rps": round(run.rps, 1),
        "p50_ms": round(percentile(total, 50), 3),
        "p99_ms": round(percentile(total, 99), 3),
        "ttft_p50_ms": round(percentile(ttft, 50), 3),
        "ttft_p99_ms": round(percentile(ttft, 99), 3),
    }
    own = [s.overhead_ms for s in run.samples if s.overhead_ms is not None]
    if own:
        out["header_overhead_p50_ms"] = round(percentile(own, 50), 3)
        out["header_overhead_p99_ms"] = round(percentile(own, 99), 3)
    return out
