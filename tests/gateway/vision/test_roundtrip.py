"""Every format, from both SDKs, to every upstream: the image arrives byte for byte, or resized."""

from __future__ import annotations

import base64
import os

import pytest
from PIL import Image

from tests.gateway.vision.conftest import SMALL_EDGE
from tests.gateway.vision.images import FORMATS, b64, encode, image_bytes, picture, size_of
from tests.gateway.vision.upstream_view import forwarded_images

MODELS = ["claude", "gpt", "llama"]


def _openai_image(oai, model: str, media_type: str, data: str, stream: bool = False) -> str:
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}},
    ]
    kwargs = {"model": model, "messages": [{"role": "user", "content": content}]}
    if not stream:
        return oai.chat.completions.create(**kwargs).choices[0].message.content
    return "".join(
        c.choices[0].delta.content or ""
        for c in oai.chat.completions.create(stream=True, **kwargs)
        if c.choices
    )


def _anthropic_image(claude, model: str, media_type: str, data: str) -> str:
    content = [
        {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}},
        {"type": "text", "text": "what is this?"},
    ]
    msg = claude.messages.create(
        model=model, max_tokens=50, messages=[{"role": "user", "content": content}]
    )
    return msg.content[0].text


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("media_type", list(FORMATS))
def test_openai_client_passes_images_through_untouched(oai, upstreams, model, media_type):
    raw = image_bytes(media_type)
    assert _openai_image(oai, model, media_type, b64(raw)) == f"image: {media_type} {len(raw)}"
    assert [data for _, data in forwarded_images(upstreams, model)] == [b64(raw)], "re-encoded"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("media_type", list(FORMATS))
def test_anthropic_client_passes_images_through_untouched(claude, upstreams, model, media_type):
    raw = image_bytes(media_type)
    assert (
        _anthropic_image(claude, model, media_type, b64(raw)) == f"image: {media_type} {len(raw)}"
    )
    assert [data for _, data in forwarded_images(upstreams, model)] == [b64(raw)], "re-encoded"


@pytest.mark.parametrize("media_type", ["image/jpeg", "image/png", "image/webp"])
def test_too_large_for_the_upstream_is_resized_in_its_format(oai, claude, upstreams, media_type):
    raw = image_bytes(media_type, 200, 100)
    text = _anthropic_image(claude, "claude-small", media_type, b64(raw))
    [(sent_type, data)] = forwarded_images(upstreams, "claude-small")
    sent = base64.b64decode(data)
    assert sent_type == media_type and text == f"image: {media_type} {len(sent)}"
    assert size_of(sent) == (SMALL_EDGE, SMALL_EDGE // 2)
    # The same image to a model without that limit is not touched.
    assert (
        _openai_image(oai, "claude", media_type, b64(raw), stream=True)
        == f"image: {media_type} {len(raw)}"
    )


def test_resized_gif_becomes_png(claude, upstreams):
    raw = image_bytes("image/gif", 128, 128)
    assert _anthropic_image(claude, "claude-small", "image/gif", b64(raw)).startswith(
        "image: image/png "
    )
    [(sent_type, data)] = forwarded_images(upstreams, "claude-small")
    assert sent_type == "image/png" and size_of(base64.b64decode(data)) == (SMALL_EDGE, SMALL_EDGE)


def test_over_the_upstream_byte_cap_is_shrunk_until_it_fits(claude, upstreams):
    # Noise does not compress: a 180×180 PNG of it is ~97 KB, over claude-small's 64 KiB per image.
    raw = encode(Image.frombytes("RGB", (180, 180), os.urandom(180 * 180 * 3)), "image/png")
    assert len(raw) > 64 * 1024
    text = _anthropic_image(claude, "claude-small", "image/png", b64(raw))
    [(sent_type, data)] = forwarded_images(upstreams, "claude-small")
    sent = base64.b64decode(data)
    assert len(sent) <= 64 * 1024 and text == f"image: {sent_type} {len(sent)}"
    assert max(size_of(sent)) <= SMALL_EDGE


def test_several_images_in_one_turn(claude, upstreams):
    jpeg, png = image_bytes("image/jpeg"), image_bytes("image/png")
    content = [
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/jpeg", "data": b64(jpeg)},
        },
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": b64(png)},
        },
    ]
    msg = claude.messages.create(
        model="gpt", max_tokens=50, messages=[{"role": "user", "content": content}]
    )
    assert msg.content[0].text == f"image: image/jpeg {len(jpeg)} image: image/png {len(png)}"


def test_exif_orientation_is_baked_in_when_resizing(claude, upstreams):
    im = picture(200, 100)
    exif = im.getexif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    raw = encode(im, "image/jpeg", exif=exif.tobytes())
    _anthropic_image(claude, "claude-small", "image/jpeg", b64(raw))
    [(_, data)] = forwarded_images(upstreams, "claude-small")
    assert size_of(base64.b64decode(data)) == (SMALL_EDGE // 2, SMALL_EDGE)  # upright: portrait now


def test_images_inside_tool_results_are_checked_too(claude, upstreams):
    import anthropic

    call = {"type": "tool_use", "id": "toolu_1", "name": "camera", "input": {}}
    png = image_bytes("image/png")

    def result(data: str) -> dict:
        image = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": data},
        }
        return {"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}

    def ask(data: str):
        return claude.messages.create(
            model="claude",
            max_tokens=50,
            messages=[
                {"role": "user", "content": "take a picture"},
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result(data)]},
            ],
        )

    assert ask(b64(png)).content[0].text.startswith("tool said")
    sent = upstreams["anthropic"].requests[-1].body["messages"][-1]["content"][0]["content"][0]
    assert sent["source"]["data"] == b64(png)
    with pytest.raises(anthropic.BadRequestError, match="truncated"):
        ask(b64(png[:-20]))
