"""Small images of every supported format, and the hostile ones the gateway must refuse."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image

FORMATS = {"image/jpeg": "JPEG", "image/png": "PNG", "image/gif": "GIF", "image/webp": "WEBP"}


def picture(width: int, height: int, mode: str = "RGB") -> Image.Image:
    """A gradient (compresses like a photo does, unlike noise or a flat colour)."""
    im = Image.linear_gradient("L").resize((width, height))
    return Image.merge("RGB", (im, im.transpose(Image.Transpose.FLIP_LEFT_RIGHT), im)).convert(mode)


def encode(im: Image.Image, media_type: str, **options: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, FORMATS[media_type], **options)
    return buf.getvalue()


def image_bytes(media_type: str, width: int = 24, height: int = 16) -> bytes:
    return encode(picture(width, height), media_type)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def size_of(raw: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(raw)) as im:
        return im.size


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A ~100-byte PNG whose header promises width × height pixels (1.2 GB decoded for 20000²)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)  # far too little data; nothing may ever try to decode it
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )
