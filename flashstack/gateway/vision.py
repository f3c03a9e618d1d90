"""Image payloads: parsed at the wire edges, then checked, fetched and normalized before routing.

Parsing (`image_from_url`, `checked_base64_image`) is cheap and runs while the request is
translated. `prepare` does the expensive part once the model is known: decode base64 (pybase64,
SIMD), check magic bytes against the declared media type, refuse truncated files and decompression
bombs from the header alone, and resize + re-encode only the images the target upstream cannot
take. Untouched images keep their original base64 text: no re-encoding, no copy.
"""

from __future__ import annotations

import asyncio
import binascii
import io
import logging
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import pybase64
from PIL import Image as PILImage
from PIL import ImageOps, UnidentifiedImageError

from flashstack.gateway import vision_gpu
from flashstack.gateway.core import (
    ChatRequest,
    ErrorKind,
    GatewayError,
    Image,
    ToolResult,
    invalid_request,
)

if TYPE_CHECKING:
    from flashstack.config import ImageTargetLimits, ModelConfig, VisionConfig

log = logging.getLogger("flashstack.gateway.vision")
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_PIL_FORMAT = {"image/jpeg": "JPEG", "image/png": "PNG", "image/gif": "GIF", "image/webp": "WEBP"}
# Pillow's own bomb guard, as a second line behind the header check in `inspect` (which uses the
# configured cap). Pillow raises only above twice this value.
PILImage.MAX_IMAGE_PIXELS = 64_000_000
# Between that and twice it Pillow only warns; `inspect` refuses those itself, with a clear 400.
warnings.filterwarnings("ignore", category=PILImage.DecompressionBombWarning)
JPEG_QUALITY = 90


@dataclass(slots=True)
class ImagePayload(Image):
    """An Image that remembers where in the caller's request it came from, for error messages."""

    param: str | None = None


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


# ---- parsing at the edges ---------------------------------------------------------------------


def image_from_url(url: str, param: str) -> Image:
    """An Image from an OpenAI image_url: a base64 data URI, or an http(s) reference."""
    if url.startswith("data:"):
        header, sep, data = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise invalid_request(
                "image data URI must look like data:image/png;base64,<data>", param
            )
        return checked_base64_image(header[5:-7], data, param)
    if url.startswith(("http://", "https://")):
        return ImagePayload(url=url, param=param)
    raise invalid_request("image_url.url must be a data: URI or an http(s) URL", param)


def checked_base64_image(media_type: str, data: str, param: str) -> Image:
    """An Image by value; the media type is checked here, the bytes later by `prepare`."""
    if media_type not in MEDIA_TYPES:
        raise invalid_request(
            f"image media type {media_type!r} is not supported; use one of {', '.join(MEDIA_TYPES)}",
            param,
        )
    if not data:
        raise invalid_request("image data is empty", param)
    return ImagePayload(media_type=media_type, data=data, param=param)


# ---- checks on bytes ----------------------------------------------------------------------------


def decode_base64(data: str, param: str | None) -> bytes:
    """Strict base64 → bytes (pybase64's SIMD decoder); anything else is the caller's 400."""
    # None: the GPU decode was measured slower at every size (docs/benchmarks.md, "Vision").
    gpu_from = vision_gpu.GPU_BASE64_MIN_BYTES
    try:
        if gpu_from is not None and len(data) >= gpu_from and vision_gpu.available():
            return vision_gpu.b64decode_gpu(data)
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
        raise _too_large(len(raw), cfg.max_image_bytes, param)
    actual = sniff(raw)
    if actual is None:
        raise invalid_request(
            f"image data is not a JPEG, PNG, GIF or WebP image (its first bytes are {raw[:8].hex()})",
            param,
        )
    if declared is not None and declared != actual:
        raise invalid_request(
            f"image is declared as {declared} but its bytes are {actual}; send the right media type",
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


def _too_large(size: int, cap: int, param: str | None) -> GatewayError:
    return GatewayError(
        ErrorKind.REQUEST_TOO_LARGE,
        f"image is {size} bytes, over the gateway's cap of {cap} (vision.max_image_bytes); "
        "send a smaller image",
        param=param,
    )


# ---- normalizing for the target upstream --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """The strictest limits among the deployments a request may go to."""

    max_long_edge: int | None
    max_bytes: int


def target_for(configs: Sequence[ModelConfig], cfg: VisionConfig) -> Target:
    """Combine every deployment's image limits (by model name, else by provider) into one."""
    edges, sizes = [], [cfg.max_image_bytes]
    for m in configs:
        lim: ImageTargetLimits | None = cfg.model_targets.get(m.name) or cfg.targets.get(m.provider)
        if lim is not None:
            edges += [lim.max_long_edge] if lim.max_long_edge else []
            sizes += [lim.max_bytes] if lim.max_bytes else []
    return Target(min(edges) if edges else None, min(sizes))


def fits(info: ImageInfo, target: Target) -> bool:
    """True when the upstream takes the image as it is."""
    edge_ok = target.max_long_edge is None or max(info.width, info.height) <= target.max_long_edge
    return edge_ok and info.size <= target.max_bytes


def scaled_size(width: int, height: int, long_edge: int | None) -> tuple[int, int]:
    """(w, h) with the long edge at most `long_edge`, aspect ratio kept."""
    if long_edge is None or max(width, height) <= long_edge:
        return width, height
    scale = long_edge / max(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def resize_cpu(raw: bytes, info: ImageInfo, target: Target) -> tuple[bytes, str]:
    """Decode, resize to fit `target`, re-encode (Pillow); returns (bytes, media type)."""
    size = scaled_size(*info.display_size, target.max_long_edge)
    out, media_type = _reencode(raw, info, size)
    # Over the byte cap at this size: shrink by the byte ratio (bytes grow with area) and retry.
    for _ in range(4):
        if len(out) <= target.max_bytes:
            return out, media_type
        factor = 0.9 * (target.max_bytes / len(out)) ** 0.5
        size = (max(1, int(size[0] * factor)), max(1, int(size[1] * factor)))
        out, media_type = _reencode(raw, info, size)
    if len(out) > target.max_bytes:
        raise _too_large(len(out), target.max_bytes, None)
    return out, media_type


def _reencode(raw: bytes, info: ImageInfo, size: tuple[int, int]) -> tuple[bytes, str]:
    with PILImage.open(io.BytesIO(raw)) as im:
        if info.media_type == "image/jpeg":
            # DCT-domain downscale: the decoder produces ≥ the target size, not all 12 MP.
            im.draft("RGB", size if info.display_size == im.size else size[::-1])
        if info.orientation != 1:  # re-encoding drops EXIF, so bake the orientation in
            im = ImageOps.exif_transpose(im)
        if im.size != size:
            im = im.resize(size, PILImage.Resampling.BICUBIC, reducing_gap=2.0)
        return encode(im, info.media_type)


def encode(im: PILImage.Image, media_type: str) -> tuple[bytes, str]:
    """Encode in the original format; GIF becomes PNG (one frame, no palette loss)."""
    buf = io.BytesIO()
    if media_type == "image/jpeg":
        im.convert("RGB").save(buf, "JPEG", quality=JPEG_QUALITY)
    elif media_type == "image/webp":
        im.save(buf, "WEBP", quality=JPEG_QUALITY)
    else:
        # Level 3: most of the size gain at a third of the time of the default.
        im.save(buf, "PNG", compress_level=3)
        media_type = "image/png"
    return buf.getvalue(), media_type


# ---- the request hook ---------------------------------------------------------------------------


class _Deployment(Protocol):
    cfg: ModelConfig


class _Router(Protocol):
    def deployments(self, name: str) -> Sequence[_Deployment]: ...


def target_configs(router: _Router, model: str) -> list[ModelConfig]:
    """The configs of every deployment a request for `model` may reach: its group and its fallbacks."""
    configs = [d.cfg for d in router.deployments(model)]
    kinds = ("fallbacks", "context_window_fallbacks", "content_policy_fallbacks")
    fallbacks = {f for c in configs for kind in kinds for f in getattr(c, kind, ())}
    for name in sorted(fallbacks - {model}):
        try:
            configs += [d.cfg for d in router.deployments(name)]
        except GatewayError:  # an unknown fallback name is the router's to report
            continue
    return configs


def images_of(req: ChatRequest) -> Iterator[Image]:
    """Every image in the request, tool results included, in order."""
    for m in req.messages:
        for p in m.parts:
            if isinstance(p, Image):
                yield p
            elif isinstance(p, ToolResult):
                yield from (c for c in p.content if isinstance(c, Image))


_limiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


def _limiter(n: int) -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if loop not in _limiters:
        _limiters[loop] = asyncio.Semaphore(n)
    return _limiters[loop]


async def prepare(req: ChatRequest, configs: Sequence[ModelConfig], cfg: VisionConfig) -> None:
    """Check every image in `req` and normalize it for `configs`' upstreams, in place."""
    images = list(images_of(req))
    if not images:
        return
    if len(images) > cfg.max_images_per_request:
        raise invalid_request(
            f"request has {len(images)} images, over the gateway's cap of {cfg.max_images_per_request} "
            "(vision.max_images_per_request); split it into several requests",
            "messages",
        )
    await _fetch_urls(images, cfg)
    for img in images:  # refuse oversized base64 by its length, before decoding a byte of it
        if img.data is not None and len(img.data) // 4 * 3 > cfg.max_image_bytes + 2:
            raise _too_large(len(img.data) // 4 * 3, cfg.max_image_bytes, _param(img))
    target = target_for(configs, cfg)
    if sum(len(i.data or "") for i in images) <= cfg.offload_bytes:
        todo = check(images, target, cfg)  # small: cheaper inline than a thread hop
        if not todo:
            return
        async with _limiter(cfg.max_concurrent):  # a small file can still be many pixels
            await asyncio.to_thread(resize, todo, target, cfg)
        return
    async with _limiter(cfg.max_concurrent):  # decoded images held at once stay bounded
        await asyncio.to_thread(normalize, images, target, cfg)


Pending = list[tuple[Image, bytes, ImageInfo]]  # images to resize, with their bytes and header


def normalize(images: Sequence[Image], target: Target, cfg: VisionConfig) -> None:
    """Decode, check, and rewrite in place only the images `target` cannot take."""
    todo = check(images, target, cfg)
    if todo:
        resize(todo, target, cfg)


def check(images: Sequence[Image], target: Target, cfg: VisionConfig) -> Pending:
    """Decode and check every image; return those `target` cannot take as they are."""
    todo: Pending = []
    for img in images:
        assert img.data is not None
        raw = decode_base64(img.data, _param(img))
        info = inspect(raw, img.media_type, cfg, _param(img))
        img.media_type = info.media_type
        if not fits(info, target):
            todo.append((img, raw, info))
    return todo


def resize(todo: Pending, target: Target, cfg: VisionConfig) -> None:
    """Resize and re-encode in place: nvJPEG for a batch of JPEGs, Pillow for the rest."""
    done = _resize_batch_gpu(todo, target, cfg)
    for img, raw, info in todo:
        if id(img) not in done:
            done[id(img)] = resize_cpu(raw, info, target)
    for img, _, _ in todo:
        out, img.media_type = done[id(img)]
        img.data = pybase64.b64encode(out).decode("ascii")


def _resize_batch_gpu(
    todo: Pending, target: Target, cfg: VisionConfig
) -> dict[int, tuple[bytes, str]]:
    """nvJPEG for the baseline JPEGs of a batch when a GPU is there; {} otherwise."""
    jpegs = [(img, raw, info) for img, raw, info in todo if _gpu_decodable(info)]
    if cfg.gpu == "off" or len(jpegs) < cfg.gpu_min_batch:
        return {}
    if not vision_gpu.available():
        return {}
    sizes = [scaled_size(info.width, info.height, target.max_long_edge) for _, _, info in jpegs]
    try:
        outs = vision_gpu.resize_jpegs([raw for _, raw, _ in jpegs], sizes, JPEG_QUALITY)
    except RuntimeError:  # out of GPU memory, a driver hiccup: the CPU path is always there
        log.warning("GPU image resize failed; resizing on the CPU", exc_info=True)
        return {}
    # None: nvJPEG refused that one (e.g. an unusual subsampling); the CPU path takes it.
    return {
        id(img): (out, "image/jpeg")
        for (img, _, _), out in zip(jpegs, outs, strict=True)
        if out is not None and len(out) <= target.max_bytes
    }


def _gpu_decodable(info: ImageInfo) -> bool:
    plain = info.mode in ("RGB", "L") and info.orientation == 1  # nvJPEG ignores EXIF rotation
    return info.media_type == "image/jpeg" and not info.progressive and plain


def _param(img: Image) -> str | None:
    return getattr(img, "param", None)


async def _fetch_urls(images: list[Image], cfg: VisionConfig) -> None:
    urls = [img for img in images if img.data is None]
    if not urls:
        return
    if not cfg.urls.enabled:
        raise invalid_request(
            "image URLs are disabled on this gateway (vision.urls.enabled: false); "
            "send the image inline as base64",
            _param(urls[0]),
        )
    from flashstack.gateway.vision_fetch import fetch_image

    for img in urls:
        assert img.url is not None
        raw = await fetch_image(img.url, cfg.urls, _param(img))
        img.media_type = sniff(raw)  # the server's Content-Type is not trusted; `inspect` checks
        img.data = pybase64.b64encode(raw).decode("ascii")
        img.url = None
