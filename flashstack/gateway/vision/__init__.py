"""Image payloads: parsed at the wire edges, then checked, fetched and normalized before routing.

payload.py parses them while the request is translated; pipeline.py's `prepare` does the expensive
part once the model is known: fetch.py fetches image URLs safely, checks.py checks the bytes,
scaling.py fits an image to the target upstream, gpu.py resizes batches of JPEGs with nvJPEG.
"""

from flashstack.gateway.vision.checks import ImageInfo
from flashstack.gateway.vision.payload import (
    MEDIA_TYPES,
    ImagePayload,
    checked_base64_image,
    image_from_url,
)
from flashstack.gateway.vision.pipeline import prepare, target_configs
from flashstack.gateway.vision.scaling import Target

__all__ = [
    "MEDIA_TYPES",
    "ImageInfo",
    "ImagePayload",
    "Target",
    "checked_base64_image",
    "image_from_url",
    "prepare",
    "target_configs",
]
