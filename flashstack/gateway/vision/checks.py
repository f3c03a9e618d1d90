"""Checks on an image's bytes: strict base64, magic bytes, completeness and size, from the header.

Truncated files and decompression bombs are refused from the header alone: no pixel is decoded.
"""

from __future__ import annotations

import binascii
import io
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pybase64
from PIL import Image as PILImage
from PIL import UnidentifiedImageError

from flashstack.gateway.core import ErrorKind, GatewayError, invalid_request
from flashstack.gateway.vision import gpu

if TYPE_CHECKING:
    from flashstack.gateway.config import VisionConfig

_PIL_FORMAT = {"image/jpeg": "JPEG", "image/png": "PNG", "image/gif": "GIF", "image/webp": "WEBP"}
# Pillow's own bomb guard, as a second line behind the header check in `inspect` (which uses the
# configured cap). Pillow raises only above twice this value.
PILImage.MAX_IMAGE_PIXELS = 64_000_000
# Between that and twice it Pillow only warns; `inspect` refuses those itself, with a clear 400.
warnings.filterwarnings("ignore", category=PILImage.DecompressionBombWarning)


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """What the header says, read without decoding a single pixel."""

    media_type: str
    width: int
    height: int
    size: int  # decoded bytes
    progressive: bool = False  # JPEG: nvJPEG's batched path takes baseline only
    mode: str = "RGB"
    orientation: int = 1  # EXIF: 5–8 mean the picture is shown rotated by 90°

    @property
    def display_size(self) -> tuple[int, int]:
        """(w, h) as a viewer shows it, EXIF rotation applied."""
        return (
            (self.height, self.width)
            if self.orientation in (5, 6, 7, 8)
            else (self.width, self.height)
        )


def decode_base64(data: str, param: str | None) -> bytes:
    """Strict base64 → bytes (pybase64's SIMD decoder); anything else is the caller's 400."""
    # None: the GPU decode was measured slower at every size (docs/benchmarks.md, "Vision").
    gpu_from = gpu.GPU_BASE64_MIN_BYTES
    try:
        if gpu_from is not None and len(data) >= gpu_from and gpu.available():
            return gpu.b64decode_gpu(data)
        return pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise invalid_request(
            "image data is not valid base64 (standard alphabet, '=' padding, no line breaks)", param
        ) from None


def sniff(raw: bytes) -> str | None:
    """The media type the magic bytes say, or None for anything but JPEG, PNG, GIF and WebP."""
    if raw.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if raw.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if raw[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "image/webp"
    return None


def is_complete(raw: bytes, media_type: str) -> bool:
    """False when the file was cut short: its format's end marker is missing."""
    if media_type == "image/jpeg":  # EOI; cameras may pad, or append an MPF image after it
        return raw.rfind(b"\xff\xd9", max(0, len(raw) - 1024)) >= 0
    if media_type == "image/png":
        return raw.rfind(b"IEND", max(0, len(raw) - 64)) >= 0
    if media_type == "image/gif":
        return raw.rstrip(b"\0").endswith(b";")
    return int.from_bytes(raw[4:8], "little") + 8 <= len(raw)  # WebP: the RIFF size


def inspect(raw: bytes, declared: str | None, cfg: VisionConfig, param: str | None) -> ImageInfo:
    """Check size, magic bytes, completeness and pixel count; decode nothing."""
    if len(raw) > cfg.max_image_bytes:
        raise too_large(len(raw), cfg.max_image_bytes, param)
    actual = sniff(raw)
    if actual is None:
        raise invalid_request(
            "image data is not a JPEG, PNG, GIF or WebP image "
            f"(its first bytes are {raw[:8].hex()})",
            param,
        )
    if declared is not None and declared != actual:
        raise invalid_request(
            f"image is declared as {declared} but its bytes are {actual}; "
            "send the right media type",
            param,
        )
    if not is_complete(raw, actual):
        raise invalid_request(f"image data is truncated: the {actual} file ends early", param)
    width, height, progressive, mode, orientation = _header(raw, actual, param)
    if width * height > cfg.max_pixels:
        raise invalid_request(
            f"image is {width}×{height} pixels, over the gateway's cap of {cfg.max_pixels} "
            "(vision.max_pixels); scale it down before sending",
            param,
        )
    return ImageInfo(actual, width, height, len(raw), progressive, mode, orientation)


def _header(raw: bytes, media_type: str, param: str | None) -> tuple[int, int, bool, str, int]:
    # Image.open parses the header only; pixels are decoded on first access, which we never do here.
    try:
        with PILImage.open(io.BytesIO(raw), formats=[_PIL_FORMAT[media_type]]) as im:
            progressive = bool(im.info.get("progressive") or im.info.get("progression"))
            orientation = im.getexif().get(0x0112, 1) if "exif" in im.info else 1
            return im.width, im.height, progressive, im.mode, orientation
    except (
        PILImage.DecompressionBombError
    ) as e:  # "Image size (N pixels) exceeds limit of M pixels..."
        raise invalid_request(
            f"image is a decompression bomb: {str(e).split(', could be')[0]} (vision.max_pixels); "
            "scale it down before sending",
            param,
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        detail = "its header is broken" if isinstance(e, UnidentifiedImageError) else str(e)
        raise invalid_request(
            f"image data cannot be read as {media_type}: {detail}", param
        ) from None


def too_large(size: int, cap: int, param: str | None) -> GatewayError:
    return GatewayError(
        ErrorKind.REQUEST_TOO_LARGE,
        f"image is {size} bytes, over the gateway's cap of {cap} (vision.max_image_bytes); "
        "send a smaller image",
        param=param,
    )
