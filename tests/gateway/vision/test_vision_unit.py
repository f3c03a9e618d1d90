"""The vision pieces on their own: sniffing, completeness, header checks, targets, the
base64 oracle."""

from __future__ import annotations

import base64
import os

import pytest

from flashstack.gateway.config import ImageTargetLimits, ModelConfig, VisionConfig
from flashstack.gateway.core import ErrorKind, GatewayError
from flashstack.gateway.vision import checks, pipeline, scaling
from flashstack.gateway.vision import gpu as vision_gpu
from flashstack.gateway.vision.payload import ImagePayload
from tests.gateway.vision.images import (
    FORMATS,
    b64,
    encode,
    image_bytes,
    picture,
    png_bomb,
    size_of,
)


@pytest.mark.parametrize("media_type", list(FORMATS))
def test_sniff_and_complete(media_type):
    raw = image_bytes(media_type)
    assert checks.sniff(raw) == media_type
    assert checks.is_complete(raw, media_type)
    assert not checks.is_complete(raw[: len(raw) * 2 // 3], media_type)


def test_inspect_reads_the_header_only():
    info = checks.inspect(png_bomb(9000, 7000), "image/png", VisionConfig(max_pixels=10**9), None)
    # A full decode would fail: there is no pixel data behind the header.
    assert (info.width, info.height) == (9000, 7000)
    with pytest.raises(GatewayError, match="9000×7000"):
        checks.inspect(png_bomb(9000, 7000), "image/png", VisionConfig(max_pixels=10**6), "p")


def test_progressive_jpeg_is_flagged_for_the_cpu():
    raw = encode(picture(64, 48), "image/jpeg", progressive=True)
    info = checks.inspect(raw, "image/jpeg", VisionConfig(), None)
    assert info.progressive and not pipeline._gpu_decodable(info)
    assert pipeline._gpu_decodable(
        checks.inspect(image_bytes("image/jpeg"), "image/jpeg", VisionConfig(), None)
    )


def test_target_is_the_strictest_of_the_deployments():
    cfg = VisionConfig(model_targets={"tiny": ImageTargetLimits(max_long_edge=100)})
    claude = ModelConfig(name="c", provider="anthropic", model="m")
    llama = ModelConfig(name="l", provider="ollama", model="m")
    assert scaling.target_for([llama], cfg) == scaling.Target(None, cfg.max_image_bytes)
    assert scaling.target_for([llama, claude], cfg) == scaling.Target(1568, 5 * 1024 * 1024)
    tiny = ModelConfig(name="tiny", provider="anthropic", model="m")
    assert scaling.target_for([tiny], cfg).max_long_edge == 100


def test_untouched_image_keeps_its_exact_text():
    text = b64(image_bytes("image/png"))
    payload = ImagePayload(media_type="image/png", data=text)
    pipeline.normalize([payload], scaling.Target(None, 10**9), VisionConfig())
    assert payload.data is text  # the same object: nothing was re-encoded or copied


def test_resize_keeps_the_aspect_ratio_and_format():
    raw = image_bytes("image/jpeg", 3000, 1000)
    payload = ImagePayload(media_type="image/jpeg", data=b64(raw))
    pipeline.normalize([payload], scaling.Target(1568, 10**9), VisionConfig(gpu="off"))
    sent = base64.b64decode(payload.data)
    assert checks.sniff(sent) == "image/jpeg" and size_of(sent) == (1568, 523)


def test_scaled_size():
    assert scaling.scaled_size(4000, 3000, 1568) == (1568, 1176)
    assert scaling.scaled_size(100, 50, 1568) == (100, 50)
    assert scaling.scaled_size(10, 20000, 8000) == (4, 8000)


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, 5, 1000, 4099])
def test_torch_base64_oracle_matches_pybase64(size):
    import torch

    raw = os.urandom(size)
    text = base64.b64encode(raw)
    if not text:
        return
    n_quads, tail = vision_gpu._split_padding(text)
    decoded = b""
    if n_quads:
        quads = torch.frombuffer(bytearray(text[: n_quads * 4]), dtype=torch.uint8)
        decoded = vision_gpu.b64decode_torch(quads).numpy().tobytes()
    assert decoded + tail == raw


def test_torch_base64_oracle_refuses_bad_characters():
    import torch

    with pytest.raises(ValueError):
        vision_gpu.b64decode_torch(torch.frombuffer(bytearray(b"AAA!"), dtype=torch.uint8))
    with pytest.raises(ValueError):
        vision_gpu._split_padding(b"AAAAA")


def test_large_payloads_and_all_resizing_run_off_the_event_loop(monkeypatch):
    import asyncio
    import threading

    from flashstack.gateway.core import ChatRequest, Message

    seen: list[tuple[str, bool]] = []
    for name in ("check", "resize"):
        real = getattr(pipeline, name)

        def spy(*a, _name=name, _real=real):
            seen.append((_name, threading.current_thread() is threading.main_thread()))
            return _real(*a)

        monkeypatch.setattr(pipeline, name, spy)
    text = b64(image_bytes("image/png", 300, 300))
    claude = [ModelConfig(name="c", provider="anthropic", model="m")]
    for offload, configs in ((False, []), (True, []), (False, claude)):
        req = ChatRequest("m", [Message("user", [ImagePayload(media_type="image/png", data=text)])])
        cfg = VisionConfig(
            offload_bytes=len(text) - 1 if offload else len(text),
            model_targets={"c": ImageTargetLimits(max_long_edge=100)},
        )
        asyncio.run(pipeline.prepare(req, configs, cfg))
    # small, fits: checked inline; large: checked in a thread; small but too big:
    # resized in a thread
    assert seen == [("check", True), ("check", False), ("check", True), ("resize", False)]


def test_target_configs_include_the_fallback_groups():
    from types import SimpleNamespace

    def dep(name: str, provider: str, **kw) -> SimpleNamespace:
        return SimpleNamespace(cfg=ModelConfig(name=name, provider=provider, model="m", **kw))

    groups = {
        "local": [dep("local", "ollama", fallbacks=["claude", "nope"])],
        "claude": [dep("claude", "anthropic")],
    }

    class Router:
        def deployments(self, name):
            if name not in groups:
                raise GatewayError(ErrorKind.NOT_FOUND, name)
            return groups[name]

    configs = pipeline.target_configs(Router(), "local")
    assert [c.name for c in configs] == ["local", "claude"]
    assert scaling.target_for(configs, VisionConfig()).max_long_edge == 1568


def test_broken_header_says_so():
    raw = b"\xff\xd8\xff" + b"\0" * 100 + b"\xff\xd9"  # JPEG magic and end marker, nothing between
    with pytest.raises(GatewayError, match="cannot be read as image/jpeg: its header is broken"):
        checks.inspect(raw, "image/jpeg", VisionConfig(), "p")
