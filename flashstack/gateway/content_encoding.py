"""Request bodies sent with `Content-Encoding: gzip` or `deflate`, decoded under the body limit.

The decoder never produces more than the limit plus one byte, whatever the compression ratio: a
zip bomb costs the limit, not its expansion.
"""

from __future__ import annotations

import zlib

from starlette.requests import Request

from flashstack.gateway.core import ErrorKind, GatewayError, invalid_request

# The setting a user raises when a body is refused as too large: the gateway's, by default.
GATEWAY_LIMIT = "server.max_body_bytes"


async def read_body(request: Request, limit: int, setting: str = GATEWAY_LIMIT) -> bytes:
    """The request's body, decoded from gzip or deflate; a 413 naming `setting` once it passes
    `limit` bytes, read no further (a declared Content-Length over it is refused unread)."""
    decoder = BodyDecoder.for_header(request.headers.get("content-encoding"), limit, setting)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit, setting)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit, setting)
        chunks.append(decoder.feed(chunk) if decoder else chunk)
    if decoder:
        chunks.append(decoder.finish())
    return b"".join(chunks)


def too_large(limit: int, setting: str = GATEWAY_LIMIT) -> GatewayError:
    """413: the body passed the server's limit; `setting` is where the user raises it."""
    return GatewayError(
        ErrorKind.REQUEST_TOO_LARGE,
        f"request body is larger than the server's limit of {limit} bytes ({setting})",
    )


# zlib's wbits: 16 + 15 reads gzip only; 32 + 15 detects a gzip or zlib header (HTTP's "deflate").
_WBITS = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": 32 + zlib.MAX_WBITS,
}


class BodyDecoder:
    """Decompresses one request body chunk by chunk; refuses it once it decodes past
    `limit` bytes."""

    def __init__(self, encoding: str, limit: int, setting: str = GATEWAY_LIMIT) -> None:
        self.encoding = encoding
        self.limit = limit
        self.setting = setting
        self.size = 0
        self._zlib = zlib.decompressobj(_WBITS[encoding])

    @classmethod
    def for_header(
        cls, header: str | None, limit: int, setting: str = GATEWAY_LIMIT
    ) -> BodyDecoder | None:
        """The decoder a Content-Encoding header asks for; None for none or identity;
        415 otherwise."""
        encoding = (header or "").strip().lower()
        if encoding in ("", "identity"):
            return None
        if encoding not in _WBITS:
            raise GatewayError(
                ErrorKind.INVALID_REQUEST,
                status=415,
                param="content-encoding",
                message=f"Content-Encoding {header!r} is not supported; send the body "
                "uncompressed, or with a single gzip or deflate encoding",
            )
        return cls(encoding, limit, setting)

    def feed(self, data: bytes) -> bytes:
        out = []
        while data:
            try:
                piece = self._zlib.decompress(data, self.limit - self.size + 1)
            except zlib.error as e:
                raise self._corrupt(str(e)) from None
            self._grow(len(piece))
            out.append(piece)
            data = self._zlib.unconsumed_tail
            if self._zlib.eof and self._zlib.unused_data:
                raise self._corrupt("data after the end of the compressed stream")
        return b"".join(out)

    def finish(self) -> bytes:
        """What remains once the body has ended; a stream cut short is a 400."""
        try:
            tail = self._zlib.flush()
        except zlib.error as e:
            raise self._corrupt(str(e)) from None
        self._grow(len(tail))
        if not self._zlib.eof:
            raise self._corrupt("the compressed stream is truncated")
        return tail

    def _grow(self, n: int) -> None:
        self.size += n
        if self.size > self.limit:
            raise GatewayError(
                ErrorKind.REQUEST_TOO_LARGE,
                f"request body decodes ({self.encoding}) to more than the server's limit of "
                f"{self.limit} bytes ({self.setting})",
            )

    def _corrupt(self, why: str) -> GatewayError:
        return invalid_request(
            f"request body is not valid {self.encoding} (Content-Encoding): {why}",
            "content-encoding",
        )
