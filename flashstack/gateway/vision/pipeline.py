"""The request hook: every image in a request checked, fetched and normalized before routing.

`prepare` runs once the model is known: fetch image URLs, decode base64 (pybase64, SIMD), check the
bytes (checks.py), and resize + re-encode only the images the target upstream cannot take
(scaling.py; nvJPEG for batches of JPEGs where a GPU is there, gpu.py). Untouched images keep their
original base64 text: no re-encoding, no copy. Large payloads and every resize run off the loop.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import pybase64

from flashstack.gateway.core import ChatRequest, GatewayError, Image, ToolResult, invalid_request
from flashstack.gateway.vision import gpu
from flashstack.gateway.vision.checks import ImageInfo, decode_base64, inspect, sniff, too_large
from flashstack.gateway.vision.scaling import (
    JPEG_QUALITY,
    Target,
    fits,
    resize_cpu,
    scaled_size,
    target_for,
)

if TYPE_CHECKING:
    from flashstack.gateway.config import ModelConfig, VisionConfig

log = logging.getLogger("flashstack.gateway.vision")


class _Deployment(Protocol):
    cfg: ModelConfig


class _Router(Protocol):
    def deployments(self, name: str) -> Sequence[_Deployment]: ...


def target_configs(router: _Router, model: str) -> list[ModelConfig]:
    """The configs of every deployment a request for `model` may reach: its group and its
    fallbacks."""
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
            f"request has {len(images)} images, over the gateway's cap of "
            f"{cfg.max_images_per_request} "
            "(vision.max_images_per_request); split it into several requests",
            "messages",
        )
    await _fetch_urls(images, cfg)
    for img in images:  # refuse oversized base64 by its length, before decoding a byte of it
        if img.data is not None and len(img.data) // 4 * 3 > cfg.max_image_bytes + 2:
            raise too_large(len(img.data) // 4 * 3, cfg.max_image_bytes, _param(img))
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
    if not gpu.available():
        return {}
    sizes = [scaled_size(info.width, info.height, target.max_long_edge) for _, _, info in jpegs]
    try:
        outs = gpu.resize_jpegs([raw for _, raw, _ in jpegs], sizes, JPEG_QUALITY)
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
    from flashstack.gateway.vision.fetch import fetch_image

    for img in urls:
        assert img.url is not None
        raw = await fetch_image(img.url, cfg.urls, _param(img))
        img.media_type = sniff(raw)  # the server's Content-Type is not trusted; `inspect` checks
        img.data = pybase64.b64encode(raw).decode("ascii")
        img.url = None
