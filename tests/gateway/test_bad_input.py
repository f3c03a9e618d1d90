"""Bad input gets a 4xx in the caller's wire format, changes nothing, and the server
keeps serving."""

from __future__ import annotations

import httpx
import pytest

OPENAI_PATH, ANTHROPIC_PATH = "/v1/chat/completions", "/v1/messages"
OK_OPENAI = {"model": "gpt", "messages": [{"role": "user", "content": "hi"}]}
OK_ANTHROPIC = {
    "model": "claude",
    "max_tokens": 10,
    "messages": [{"role": "user", "content": "hi"}],
}


def _assert_openai_error(r: httpx.Response, status: int, needle: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"], err
    assert "Traceback" not in r.text


def _assert_anthropic_error(r: httpx.Response, status: int, needle: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert needle in body["error"]["message"], body
    assert "Traceback" not in r.text


def _still_serves(gw: httpx.Client) -> None:
    assert (
        gw.post(OPENAI_PATH, json=OK_OPENAI).json()["choices"][0]["message"]["content"]
        == "echo: hi"
    )
    assert gw.post(ANTHROPIC_PATH, json=OK_ANTHROPIC).json()["content"][0]["text"] == "echo: hi"


@pytest.fixture
def gw(gateway):
    with httpx.Client(base_url=gateway.url, timeout=10) as c:
        yield c
    with httpx.Client(base_url=gateway.url, timeout=10) as c:
        _still_serves(c)


BAD_BODIES = [
    ("malformed-json", b'{"model": "gpt", "messages": [', 400, "not valid JSON"),
    ("not-an-object", b"[1, 2, 3]", 400, "JSON object"),
    ("missing-messages", b'{"model": "gpt"}', 400, "messages"),
    ("wrong-type", b'{"model": "gpt", "messages": "hello"}', 400, "messages"),
    ("empty-messages", b'{"model": "gpt", "messages": []}', 400, "messages"),
    (
        "bad-role",
        b'{"model": "gpt", "messages": [{"role": "wizard", "content": "x"}]}',
        400,
        "messages",
    ),
    (
        "bad-temperature",
        b'{"model": "gpt", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
        400,
        "temperature",
    ),
    (
        "unknown-model",
        b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}',
        404,
        "nope",
    ),
]


@pytest.mark.parametrize("name,body,status,needle", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_openai_bad_bodies(gw, name, body, status, needle):
    r = gw.post(OPENAI_PATH, content=body, headers={"content-type": "application/json"})
    _assert_openai_error(r, status, needle)
    if name == "unknown-model":
        assert r.json()["error"]["code"] == "model_not_found"


BAD_ANTHROPIC = [
    ("malformed-json", b'{"model": "claude", ', 400, "not valid JSON"),
    (
        "missing-max-tokens",
        b'{"model": "claude", "messages": [{"role": "user", "content": "x"}]}',
        400,
        "max_tokens",
    ),
    (
        "wrong-type",
        b'{"model": "claude", "max_tokens": "ten", "messages": [{"role": "user", "content": "x"}]}',
        400,
        "max_tokens",
    ),
    # An unknown block type passes to an Anthropic upstream (it may be newer than the gateway); to
    # an OpenAI-compatible one it has no counterpart: a 400 naming it.
    (
        "bad-block",
        b'{"model": "gpt", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": '
        b'"video"}]}]}',
        400,
        "type=video",
    ),
    (
        "unknown-model",
        b'{"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}',
        404,
        "nope",
    ),
]


@pytest.mark.parametrize(
    "name,body,status,needle", BAD_ANTHROPIC, ids=[b[0] for b in BAD_ANTHROPIC]
)
def test_anthropic_bad_bodies(gw, name, body, status, needle):
    r = gw.post(ANTHROPIC_PATH, content=body, headers={"content-type": "application/json"})
    _assert_anthropic_error(r, status, needle)
    if name == "unknown-model":
        assert r.json()["error"]["type"] == "not_found_error"


def test_oversize_body_is_refused_in_both_formats(gw):
    # The test gateway's limit is 1 MiB.
    big = "x" * (2 * 1024 * 1024)
    r = gw.post(OPENAI_PATH, json={"model": "gpt", "messages": [{"role": "user", "content": big}]})
    _assert_openai_error(r, 413, "limit")
    assert r.headers["connection"] == "close"  # the unread rest of the body ends the connection
    r = gw.post(
        ANTHROPIC_PATH, json={**OK_ANTHROPIC, "messages": [{"role": "user", "content": big}]}
    )
    _assert_anthropic_error(r, 413, "limit")
    assert r.json()["error"]["type"] == "request_too_large"


def test_oversize_chunked_body_without_length_is_refused(gw):
    def chunks():
        yield b'{"model": "gpt", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}]}'

    r = gw.post(OPENAI_PATH, content=chunks(), headers={"content-type": "application/json"})
    _assert_openai_error(r, 413, "limit")


def test_invalid_base64_image(gw):
    bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@not-base64@@@"}}]
    r = gw.post(OPENAI_PATH, json={"model": "gpt", "messages": [{"role": "user", "content": bad}]})
    _assert_openai_error(r, 400, "base64")
    assert r.json()["error"]["param"].startswith("messages[0].content[0]")
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "%%%"},
    }
    r = gw.post(
        ANTHROPIC_PATH, json={**OK_ANTHROPIC, "messages": [{"role": "user", "content": [block]}]}
    )
    _assert_anthropic_error(r, 400, "base64")


def test_unsupported_media_type(gw):
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/tiff", "data": "AAAA"},
    }
    r = gw.post(
        ANTHROPIC_PATH, json={**OK_ANTHROPIC, "messages": [{"role": "user", "content": [block]}]}
    )
    _assert_anthropic_error(r, 400, "image/tiff")


def test_image_to_text_only_model_is_a_clear_400(gw, upstreams):
    before = len(upstreams["openai"].requests)
    url = "data:image/png;base64,iVBORw0KGgo="
    content = [{"type": "image_url", "image_url": {"url": url}}]
    r = gw.post(
        OPENAI_PATH, json={"model": "textonly", "messages": [{"role": "user", "content": content}]}
    )
    _assert_openai_error(r, 400, "does not accept images")
    assert len(upstreams["openai"].requests) == before, "nothing may reach the upstream"


def test_invalid_json_schema_is_refused(gw):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    r = gw.post(OPENAI_PATH, json={**OK_OPENAI, "response_format": rf})
    _assert_openai_error(r, 400, "not a valid JSON Schema")


def test_unknown_path_and_method(gw):
    r = gw.get("/v1/nothing-here")
    _assert_openai_error(r, 404, "/v1/nothing-here")
    r = gw.get(ANTHROPIC_PATH)
    assert r.status_code == 405 and r.json()["type"] == "error"


def test_bad_stream_request_is_an_http_error_not_a_stream(gw):
    r = gw.post(OPENAI_PATH, json={"model": "gpt", "stream": True, "messages": "x"})
    _assert_openai_error(r, 400, "messages")
    assert r.headers["content-type"].startswith("application/json")
