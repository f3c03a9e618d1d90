"""Fitting an image to the target upstream: the strictest limits, resize and re-encode (Pillow)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PIL import Image as PILImage
from PIL import ImageOps

from flashstack.gateway.vision.checks import ImageInfo, too_large

if TYPE_CHECKING:
    from flashstack.gateway.config import ImageTargetLimits, ModelConfig, VisionConfig

JPEG_QUALITY = 90


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
        raise too_large(len(out), target.max_bytes, None)
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
