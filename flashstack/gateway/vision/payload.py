"""Image payloads parsed at the wire edges: cheap, while the request is translated.

The media type is checked here; the bytes later, by `prepare`, once the model is known.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashstack.gateway.core import Image, invalid_request

MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


@dataclass(slots=True)
class ImagePayload(Image):
    """An Image that remembers where in the caller's request it came from, for error messages."""

    param: str | None = None


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
            f"image media type {media_type!r} is not supported; use one of "
            f"{', '.join(MEDIA_TYPES)}",
            param,
        )
    if not data:
        raise invalid_request("image data is empty", param)
    return ImagePayload(media_type=media_type, data=data, param=param)
