"""The GPU paths against the CPU ones (needs CUDA, torchvision and triton; skipped without them).

Runs without the gateway's conftest (`pytest --noconftest tests/gateway/vision/test_gpu.py`) on a
GPU machine that has no web stack.
"""

from __future__ import annotations

import base64
import os
from types import SimpleNamespace

import pytest

from flashstack.gateway.core import GatewayError
from flashstack.gateway.vision import gpu as vision_gpu
from flashstack.gateway.vision import pipeline, scaling
from flashstack.gateway.vision.payload import ImagePayload
from tests.gateway.vision.images import encode, picture, size_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not vision_gpu.available(), reason="needs CUDA + torchvision"),
]
CFG = SimpleNamespace(gpu="auto", gpu_min_batch=2, max_image_bytes=64 << 20, max_pixels=64_000_000)


@pytest.mark.parametrize("size", [1, 2, 3, 1000, 3 * 1024 * 1024 + 1])
def test_triton_base64_matches_pybase64(size):
    import torch

    raw = os.urandom(size)
    text = base64.b64encode(raw).decode()
    assert vision_gpu.b64decode_gpu(text) == raw
    staging = torch.empty(len(text) + 8, dtype=torch.uint8).pin_memory()
    out = torch.empty(size + 8, dtype=torch.uint8).pin_memory()
    assert vision_gpu.b64decode_gpu(text, staging, out) == raw


def test_triton_base64_refuses_bad_characters():
    text = bytearray(base64.b64encode(os.urandom(3000)))
    text[1234] = ord("!")
    with pytest.raises(ValueError):
        vision_gpu.b64decode_gpu(bytes(text))


def test_nvjpeg_batch_resizes_like_pillow():
    raws = [encode(picture(640, 480), "image/jpeg") for _ in range(3)]
    outs = vision_gpu.resize_jpegs(raws, [(320, 240)] * 3, 90)
    assert all(out is not None and size_of(out) == (320, 240) for out in outs)


def test_batch_mixes_gpu_and_cpu_fallbacks():
    baseline = encode(picture(640, 480), "image/jpeg")
    progressive = encode(picture(640, 480), "image/jpeg", progressive=True)
    payloads = [
        ImagePayload(media_type="image/jpeg", data=base64.b64encode(r).decode())
        for r in (baseline, baseline, progressive, b"\xff\xd8\xff" + b"\0" * 100 + b"\xff\xd9")
    ]
    with pytest.raises(
        GatewayError, match="cannot be read"
    ):  # the broken one is refused before any GPU work
        pipeline.normalize(payloads, scaling.Target(320, 1 << 30), CFG)
    payloads = payloads[:3]
    pipeline.normalize(payloads, scaling.Target(320, 1 << 30), CFG)
    assert [size_of(base64.b64decode(p.data)) for p in payloads] == [(320, 240)] * 3
