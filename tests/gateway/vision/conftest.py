"""Gateways with vision limits small enough to test quickly, in front of the faithful fakes."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from flashstack.gateway.app import create_app
from flashstack.gateway.config import ImageTargetLimits, ImageURLConfig, VisionConfig
from tests.fakes.server import FakeServer
from tests.gateway.conftest import gateway_config
from tests.gateway.vision.images import image_bytes

MAX_IMAGES = 4
MAX_IMAGE_BYTES = 256 * 1024
SMALL_EDGE = 64  # the long edge that model "claude-small" takes


def vision_config(**overrides: object) -> VisionConfig:
    return VisionConfig(
        max_image_bytes=MAX_IMAGE_BYTES,
        max_images_per_request=MAX_IMAGES,
        model_targets={
            "claude-small": ImageTargetLimits(max_long_edge=SMALL_EDGE, max_bytes=64 * 1024)
        },
        **overrides,
    )


def _start(upstreams, vision: VisionConfig, **server: object) -> FakeServer:
    config = gateway_config(upstreams, **server)
    small = config.models[0].model_copy(update={"name": "claude-small"})
    config = config.model_copy(update={"models": [*config.models, small], "vision": vision})
    return FakeServer(create_app(config), lifespan="on", loop="uvloop").start()


@pytest.fixture(scope="session")
def vision_gateway(upstreams):
    server = _start(upstreams, vision_config(), max_body_bytes=4 * 1024 * 1024)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def image_host():
    """An http server with images, a redirect to one, and an endless one."""
    png = image_bytes("image/png")

    async def big(request):
        return Response(
            b"\x89PNG\r\n\x1a\n" + b"\0" * (2 * MAX_IMAGE_BYTES), media_type="image/png"
        )

    app = Starlette(
        routes=[
            Route("/cat.png", lambda r: Response(png, media_type="image/png")),
            Route("/redirect", lambda r: RedirectResponse("/cat.png", status_code=302)),
            Route("/big.png", big),
            Route("/missing.png", lambda r: Response(b"no", status_code=404)),
        ]
    )
    server = FakeServer(app).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def url_gateway(upstreams, image_host):
    """URLs on, for 127.0.0.1 only (private addresses allowed, as a trusted intranet would)."""
    urls = ImageURLConfig(
        enabled=True,
        allowed_hosts=["127.0.0.1"],
        allow_private_addresses=True,
        max_bytes=MAX_IMAGE_BYTES,
        timeout=5,
    )
    server = _start(upstreams, vision_config(urls=urls))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def public_only_gateway(upstreams):
    """URLs on, public addresses only (the safe production setting)."""
    server = _start(upstreams, vision_config(urls=ImageURLConfig(enabled=True)))
    yield server
    server.stop()


@pytest.fixture
def gw(vision_gateway):
    with httpx.Client(base_url=vision_gateway.url, timeout=20) as c:
        yield c


@pytest.fixture(scope="session")
def oai(vision_gateway):
    return openai.OpenAI(
        base_url=vision_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=20
    )


@pytest.fixture(scope="session")
def claude(vision_gateway):
    return anthropic.Anthropic(
        base_url=vision_gateway.url, api_key="unused", max_retries=0, timeout=20
    )
