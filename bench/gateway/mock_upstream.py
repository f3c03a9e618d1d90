"""A mock OpenAI + Anthropic upstream (chat, messages, embeddings) that is never the bottleneck: raw
asyncio protocol on uvloop.

Responses are canned bytes built once at start-up; a request is parsed only as far as its path,
its Content-Length and whether it asks for a stream. Streams send `--chunks` content events,
`--gap-ms` apart (0: the whole stream in one write), each SSE event in its own HTTP chunk.

    python bench/gateway/mock_upstream.py --port 9100 --chunks 20 --gap-ms 1
"""

from __future__ import annotations

import argparse
import asyncio
import json

FIRST_TOKEN = "Hello"  # the load generator's time-to-first-token marker
_MODELS = json.dumps(
    {
        "object": "list",
        "data": [{"id": "gpt-4o-mini", "object": "model", "created": 0, "owned_by": "mock"}],
    }
).encode()


def _words(n: int) -> list[str]:
    return [FIRST_TOKEN] + [f" w{i}" for i in range(1, n)]


def openai_body(n: int) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-mock",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "gpt-4o-mini",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(_words(n))},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n},
        }
    ).encode()


def embeddings_body(dimensions: int = 1536) -> bytes:
    """One embedding of text-embedding-3-small's size (a ~20 KB body)."""
    vector = [round(((i * 7919) % 2000 - 1000) / 31623, 6) for i in range(dimensions)]
    return json.dumps(
        {
            "object": "list",
            "model": "text-embedding-3-small",
            "data": [{"object": "embedding", "index": 0, "embedding": vector}],
            "usage": {"prompt_tokens": 6, "total_tokens": 6},
        }
    ).encode()


def anthropic_body(n: int) -> bytes:
    return json.dumps(
        {
            "id": "msg_mock",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "content": [{"type": "text", "text": "".join(_words(n))}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 12, "output_tokens": n},
        }
    ).encode()


def openai_events(n: int) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """(head, one event per content token, tail) of an OpenAI chat.completion.chunk stream."""

    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
        choices = (
            []
            if usage
            else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        )
        body = {
            "id": "chatcmpl-mock",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": "gpt-4o-mini",
            "choices": choices,
            "usage": usage,
        }
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    head = [chunk({"role": "assistant", "content": ""})]
    body = [chunk({"content": w}) for w in _words(n)]
    usage = {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n}
    tail = [chunk({}, "stop"), chunk({}, usage=usage), b"data: [DONE]\n\n"]
    return head, body, tail


def anthropic_events(n: int) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """(head, one event per content token, tail) of an Anthropic Messages stream."""

    def event(name: str, data: dict) -> bytes:
        return f"event: {name}\ndata: ".encode() + json.dumps(data).encode() + b"\n\n"

    message = {
        "id": "msg_mock",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 1},
    }
    head = [
        event("message_start", {"type": "message_start", "message": message}),
        event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        event("ping", {"type": "ping"}),
    ]
    body = [
        event(
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": w}},
        )
        for w in _words(n)
    ]
    tail = [
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": n},
            },
        ),
        event("message_stop", {"type": "message_stop"}),
    ]
    return head, body, tail


def _chunked(event: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(event), event)


def _json_response(body: bytes, status: bytes = b"200 OK") -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


class Canned:
    """Every response the mock sends, rendered once."""

    def __init__(self, chunks: int, gap_ms: float) -> None:
        self.gap = gap_ms / 1000
        self.openai = _json_response(openai_body(chunks))
        self.anthropic = _json_response(anthropic_body(chunks))
        self.models = _json_response(_MODELS)
        self.embeddings = _json_response(embeddings_body())
        self.not_found = _json_response(
            b'{"error":{"message":"no such route","type":"not_found"}}', b"404 Not Found"
        )
        self.openai_stream = self._stream(*openai_events(chunks))
        self.anthropic_stream = self._stream(*anthropic_events(chunks))

    @staticmethod
    def _stream(head: list[bytes], body: list[bytes], tail: list[bytes]) -> list[bytes]:
        # Writes: the headers plus everything up to and including the first token, then one
        # write per later token, then the tail and the terminating zero-length chunk.
        first = _STREAM_HEAD + b"".join(_chunked(e) for e in head) + _chunked(body[0])
        return [
            first,
            *(_chunked(e) for e in body[1:]),
            b"".join(_chunked(e) for e in tail) + b"0\r\n\r\n",
        ]


def content_length(head: bytes) -> int:
    """The Content-Length of a lower-cased header block (0 when absent)."""
    i = head.find(b"content-length:")
    if i < 0:
        return 0
    j = head.find(b"\r\n", i)
    return int(head[i + 15 : j if j >= 0 else len(head)])


class MockProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; requests are answered in order."""

    def __init__(self, canned: Canned) -> None:
        self.canned = canned
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy: asyncio.Task | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy is not None:
            self.busy.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.busy is None:
            self._drain()

    def _drain(self) -> None:
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            length = content_length(head)
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            path = head[head.find(b" ") + 1 : head.find(b" http/")]
            if not self._respond(path, body):
                return

    def _respond(self, path: bytes, body: bytes) -> bool:
        """Answer one request; False when a paced stream now owns the connection."""
        c, t = self.canned, self.transport
        assert t is not None
        stream = b'"stream":true' in body or b'"stream": true' in body
        if path.endswith(b"/chat/completions"):
            parts = c.openai_stream if stream else [c.openai]
        elif path.endswith(b"/messages"):
            parts = c.anthropic_stream if stream else [c.anthropic]
        elif path.endswith(b"/embeddings"):
            parts = [c.embeddings]
        elif path.endswith(b"/models"):
            parts = [c.models]
        else:
            parts = [c.not_found]
        if len(parts) == 1 or c.gap <= 0:
            t.write(b"".join(parts))
            return True
        self.busy = asyncio.get_running_loop().create_task(self._paced(parts))
        return False

    async def _paced(self, parts: list[bytes]) -> None:
        t = self.transport
        assert t is not None
        t.write(parts[0])
        for p in parts[1:]:
            await asyncio.sleep(self.canned.gap)
            if t.is_closing():
                return
            t.write(p)
        self.busy = None
        self._drain()


async def serve(host: str, port: int, canned: Canned) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: MockProtocol(canned), host, port, backlog=4096)
    print(f"mock upstream on http://{host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9100)
    p.add_argument("--chunks", type=int, default=20, help="content events per stream")
    p.add_argument("--gap-ms", type=float, default=0.0, help="pause between content events")
    args = p.parse_args()
    import uvloop

    uvloop.run(serve(args.host, args.port, Canned(args.chunks, args.gap_ms)))


if __name__ == "__main__":
    main()
