"""Image payloads: parsing data URIs and checking base64 before anything is forwarded."""

from __future__ import annotations

import binascii

import pybase64

from flashstack.gateway.core import Image, invalid_request

MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def image_from_url(url: str, param: str) -> Image:
    """An Image from an OpenAI image_url: a base64 data URI, or an http(s) reference."""
    if url.startswith("data:"):
        header, sep, data = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise invalid_request("image data URI must look like data:image/png;base64,<data>", param)
        media_type = header[5:-7]
        return checked_base64_image(media_type, data, param)
    if url.startswith(("http://", "https://")):
        return Image(url=url)
    raise invalid_request("image_url.url must be a data: URI or an http(s) URL", param)


def checked_base64_image(media_type: str, data: str, param: str) -> Image:
    """Reject unsupported media types and data that is not valid base64."""
    if media_type not in MEDIA_TYPES:
        raise invalid_request(
            f"image media type {media_type!r} is not supported; use one of {', '.join(MEDIA_TYPES)}", param
        )
    try:
        raw = pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise invalid_request("image data is not valid base64", param) from None
    if not raw:
        raise invalid_request("image data is empty", param)
    return Image(media_type=media_type, data=data)
