"""Hostile and broken images get the right 4xx in the caller's format; nothing
reaches an upstream."""

from __future__ import annotations

import pytest

from tests.gateway.vision.conftest import MAX_IMAGE_BYTES, MAX_IMAGES
from tests.gateway.vision.images import b64, image_bytes, png_bomb
from tests.gateway.vision.upstream_view import chat_request_count

# Pillow warns about big headers before the gateway refuses them; the refusal is what is tested.
pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")

JPEG, PNG, GIF, WEBP = (
    image_bytes(t) for t in ("image/jpeg", "image/png", "image/gif", "image/webp")
)

# (id, declared media type, base64 data, status, what the message must say)
BAD = [
    ("truncated-jpeg", "image/jpeg", b64(JPEG[: len(JPEG) // 2]), 400, "truncated"),
    ("truncated-png", "image/png", b64(PNG[:-20]), 400, "truncated"),
    ("truncated-gif", "image/gif", b64(GIF[:-5]), 400, "truncated"),
    ("truncated-webp", "image/webp", b64(WEBP[:-10]), 400, "truncated"),
    ("png-signature-only", "image/png", "iVBORw0KGgo=", 400, "truncated"),
    (
        "wrong-magic",
        "image/png",
        b64(b"GIF88a? no, this is text, not an image at all"),
        400,
        "not a JPEG, PNG",
    ),
    (
        "lying-media-type",
        "image/jpeg",
        b64(PNG),
        400,
        "declared as image/jpeg but its bytes are image/png",
    ),
    ("webp-as-gif", "image/gif", b64(WEBP), 400, "its bytes are image/webp"),
    ("png-bomb-20000x20000", "image/png", b64(png_bomb()), 400, "400000000 pixels"),
    ("png-bomb-9000x9000", "image/png", b64(png_bomb(9000, 9000)), 400, "9000×9000"),
    ("invalid-base64", "image/png", "iVBORw0KGgo!!!!", 400, "not valid base64"),
    ("base64-bad-padding", "image/png", b64(PNG)[:-1], 400, "not valid base64"),
    (
        "over-byte-cap",
        "image/png",
        b64(b"\x89PNG\r\n\x1a\n" + bytes(MAX_IMAGE_BYTES)),
        413,
        "vision.max_image_bytes",
    ),
]


def _openai_body(media_type: str, data: str, n: int = 1) -> dict:
    part = {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    return {
        "model": "gpt",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "?"}] + [part] * n}],
    }


def _anthropic_body(media_type: str, data: str, n: int = 1) -> dict:
    block = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    return {
        "model": "claude",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": [block] * n}],
    }


@pytest.fixture
def untouched_upstreams(upstreams, gw):
    before = chat_request_count(upstreams)
    yield
    assert chat_request_count(upstreams) == before, "a refused request reached an upstream"
    ok = gw.post("/v1/chat/completions", json=_openai_body("image/png", b64(PNG)))
    assert ok.json()["choices"][0]["message"]["content"] == f"image: image/png {len(PNG)}", (
        "stopped serving"
    )


@pytest.mark.parametrize("name,media_type,data,status,needle", BAD, ids=[b[0] for b in BAD])
def test_openai_wire(gw, untouched_upstreams, name, media_type, data, status, needle):
    r = gw.post("/v1/chat/completions", json=_openai_body(media_type, data))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and "Traceback" not in r.text
    assert err["param"] == "messages[0].content[1].image_url.url"
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("name,media_type,data,status,needle", BAD, ids=[b[0] for b in BAD])
def test_anthropic_wire(gw, untouched_upstreams, name, media_type, data, status, needle):
    r = gw.post("/v1/messages", json=_anthropic_body(media_type, data))
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and needle in body["error"]["message"]
    assert body["error"]["type"] == (
        "request_too_large" if status == 413 else "invalid_request_error"
    )


def test_too_many_images(gw, untouched_upstreams):
    r = gw.post("/v1/messages", json=_anthropic_body("image/png", b64(PNG), MAX_IMAGES + 1))
    assert r.status_code == 400 and "vision.max_images_per_request" in r.json()["error"]["message"]


def test_as_many_images_as_allowed(gw):
    r = gw.post("/v1/chat/completions", json=_openai_body("image/png", b64(PNG), MAX_IMAGES))
    assert r.status_code == 200, r.text


def test_url_when_urls_are_disabled(gw, untouched_upstreams):
    part = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/cat.png"}}
    r = gw.post(
        "/v1/chat/completions",
        json={"model": "gpt", "messages": [{"role": "user", "content": [part]}]},
    )
    assert r.status_code == 400 and "vision.urls.enabled" in r.json()["error"]["message"]
    block = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:1/cat.png"}}
    r = gw.post(
        "/v1/messages",
        json={
            **_anthropic_body("image/png", ""),
            "messages": [{"role": "user", "content": [block]}],
        },
    )
    assert r.status_code == 400 and "send the image inline" in r.json()["error"]["message"]


def test_image_for_a_text_only_model_is_still_refused(gw, untouched_upstreams):
    body = {**_openai_body("image/png", b64(PNG)), "model": "textonly"}
    r = gw.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "does not accept images" in r.json()["error"]["message"]
