"""An OpenAI-compatible upstream on raw asyncio sockets that fails exactly as it is told to.

Raw sockets, because the faults that matter live below HTTP frameworks: a refused connection, a
reset before or after the first byte, a response that never starts, a stream that stops mid-way.

    up = FaultyUpstream("a").start()
    up.fail("status", status=503, times=2)     # the next two chat requests get 503, then normal
    up.url                                     # api_base for ModelConfig (…/v1)
    up.log                                     # one Served per chat request: tag, what it did

Faults (`mode`): ok, status (with optional retry_after), hang (read the request, never answer),
stall (send 200 headers, then nothing), reset (RST before any byte), reset_midstream (headers and
`after` chunks, then RST), malformed (a body / first chunk that is not JSON), truncate (`after`
chunks, then a clean close without finish_reason or [DONE]), refuse (stop listening).
`health` ("ok", "fail", "hang") decides how the health probe (GET /v1/models) is answered.
Every reply's text starts with the upstream's name, so a client can tell who served it.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

TAG = re.compile(r"#(\w[\w-]*)")


@dataclass
class Served:
    tag: str
    mode: str  # the fault applied ("ok" when it answered normally)
    stream: bool
    at: float = field(default_factory=time.monotonic)


@dataclass
class Fault:
    mode: str = "ok"
    times: int | None = None  # None: every request until changed
    status: int = 500
    retry_after: str | None = None
    after: int = 2  # chunks before a mid-stream fault
    message: str | None = None
    code: str | None = None


class FaultyUpstream:
    """A fault-injecting fake; runs its own event loop in a daemon thread."""

    def __init__(
        self, name: str, chunks: int = 3, interval: float = 0.0, first_byte_delay: float = 0.0
    ) -> None:
        self.name = name
        self.chunks, self.interval, self.first_byte_delay = chunks, interval, first_byte_delay
        self.fault = Fault()
        self.health = "ok"  # ok | fail | hang: how GET /v1/models (the health probe) answers
        self.health_delay = 0.0  # seconds before it answers (a server busy with a generation)
        self.log: list[Served] = []
        self.health_probes = 0
        self._lock = threading.Lock()
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"faulty-{name}", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # ---- control (called from the test thread) -----------------------------------------------

    def start(self) -> FaultyUpstream:
        self._thread.start()
        self._call(self._listen())
        return self

    def fail(
        self,
        mode: str,
        *,
        times: int | None = None,
        status: int = 500,
        retry_after: str | None = None,
        after: int = 2,
        message: str | None = None,
        code: str | None = None,
    ) -> None:
        with self._lock:
            self.fault = Fault(mode, times, status, retry_after, after, message, code)
        if mode == "refuse":
            self._call(self._kill())  # kept-alive connections too: nothing may reach it any more
        elif self._server is None:
            self._call(self._listen())

    def heal(self) -> None:
        self.fail("ok")

    def kill(self) -> None:
        """Stop listening and reset every open connection (a crashed upstream)."""
        with self._lock:
            self.fault = Fault("refuse")
        self._call(self._kill())

    def tags(self, mode: str | None = None) -> list[str]:
        return [s.tag for s in self.log if mode is None or s.mode == mode]

    def stop(self) -> None:
        self._call(self._kill())
        self._call(self._cancel_all())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _cancel_all(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _call(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(5)

    # ---- server (event-loop thread) ----------------------------------------------------------

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(
                self._serve, "127.0.0.1", self.port, reuse_address=True
            )

    async def _unlisten(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _kill(self) -> None:
        await self._unlisten()
        for w in list(self._writers):
            _reset(w)

    def _take_fault(self) -> Fault:
        with self._lock:
            f = self.fault
            if f.times is not None:
                f.times -= 1
                if f.times <= 0:
                    self.fault = Fault()
            return f

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            # Keep-alive like a real server; a response without content-length ends the connection.
            while await self._answer(*await _read_request(reader), writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            if not writer.is_closing():
                writer.close()

    async def _answer(
        self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; True when the connection stays open for the next."""
        if method == "GET" and path.endswith("/models"):
            self.health_probes += 1
            if self.health == "hang":
                await asyncio.sleep(3600)
            await asyncio.sleep(self.health_delay)
            if self.health == "ok":
                await _respond(
                    writer, 200, {"object": "list", "data": [{"id": "m", "object": "model"}]}
                )
            else:
                await _respond(
                    writer, 503, {"error": {"message": "unhealthy", "type": "server_error"}}
                )
            return True
        payload = json.loads(body)
        stream = bool(payload.get("stream"))
        text = " ".join(str(m.get("content")) for m in payload.get("messages", []))
        tag = (TAG.search(text) or re.match("(.*)", "untagged")).group(1)
        fault = self._take_fault()
        self.log.append(Served(tag, fault.mode, stream))
        return await self._apply(fault, stream, writer)

    async def _apply(self, f: Fault, stream: bool, w: asyncio.StreamWriter) -> bool:
        if f.mode == "status":
            extra = {"retry-after": f.retry_after} if f.retry_after else {}
            message = f.message or f"{self.name} says {f.status}"
            await _respond(
                w,
                f.status,
                {
                    "error": {
                        "message": message,
                        "type": "server_error",
                        "param": None,
                        "code": f.code,
                    }
                },
                extra,
            )
            return True
        if f.mode == "hang":
            await asyncio.sleep(3600)
        elif f.mode == "reset":
            _reset(w)
        elif f.mode == "stall":
            await _head(w, 200, "text/event-stream" if stream else "application/json")
            await asyncio.sleep(3600)
        elif f.mode == "malformed":
            if stream:
                await _head(w, 200, "text/event-stream")
                w.write(b"data: {this is not json\n\n")
            else:
                await _head(w, 200, "application/json")
                w.write(b"{this is not json")
            await w.drain()
        elif stream:
            await self._stream(w, f)
        else:
            await asyncio.sleep(self.first_byte_delay)
            await _respond(w, 200, self._completion())
            return True
        return False

    async def _stream(self, w: asyncio.StreamWriter, f: Fault) -> None:
        await asyncio.sleep(self.first_byte_delay)
        await _head(w, 200, "text/event-stream")
        w.write(_sse(_chunk({"role": "assistant", "content": ""})))
        for i, word in enumerate(self._words()):
            if f.mode in ("reset_midstream", "truncate") and i == f.after:
                if f.mode == "reset_midstream":
                    _reset(w)
                return
            if i and self.interval:
                await asyncio.sleep(self.interval)
            w.write(_sse(_chunk({"content": word})))
            await w.drain()
        w.write(_sse(_chunk({}, "stop")))
        usage = {
            "prompt_tokens": 3,
            "completion_tokens": self.chunks + 1,
            "total_tokens": self.chunks + 4,
        }
        w.write(_sse({**_chunk({}), "choices": [], "usage": usage}))
        w.write(b"data: [DONE]\n\n")
        await w.drain()

    def _words(self) -> list[str]:
        return [f"{self.name}:"] + [f" w{i}" for i in range(self.chunks)]

    def _completion(self) -> dict:
        return {
            "id": "chatcmpl-f",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "".join(self._words())},
                }
            ],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": self.chunks + 1,
                "total_tokens": self.chunks + 4,
            },
        }


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
    length = int(
        {k.strip().lower(): v.strip() for k, v in headers.items()}.get("content-length", "0")
    )
    body = await reader.readexactly(length) if length else b""
    return method, path, body


def _head_bytes(status: int, content_type: str, extra: dict | None = None) -> bytes:
    # no length: the body ends with the connection
    close = not extra or "content-length" not in extra
    lines = [
        f"HTTP/1.1 {status} X",
        f"content-type: {content_type}",
        f"connection: {'close' if close else 'keep-alive'}",
    ]
    lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _head(w: asyncio.StreamWriter, status: int, content_type: str) -> None:
    w.write(_head_bytes(status, content_type))
    await w.drain()


async def _respond(
    w: asyncio.StreamWriter, status: int, body: dict, extra: dict | None = None
) -> None:
    data = json.dumps(body).encode()
    w.write(
        _head_bytes(status, "application/json", {"content-length": len(data), **(extra or {})})
        + data
    )
    await w.drain()


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {
        "id": "chatcmpl-f",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _reset(w: asyncio.StreamWriter) -> None:
    """Close with RST instead of FIN (SO_LINGER 0): the peer sees 'connection reset'."""
    sock = w.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    w.transport.abort()
