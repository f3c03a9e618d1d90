"""API keys and limits through the official SDKs: 401/403/429 in each wire format, keys hashed
and shown once, per-key models, rpm/tpm limits with retry-after, expiry and revocation."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from tests.gateway.sessions.support import (
    MASTER_KEY,
    ScratchStore,
    auth_headers,
    create_key,
    gateway_config,
    start_gateway,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return ScratchStore("sqlite", tmp_path_factory.mktemp("auth"))


@pytest.fixture(scope="module")
def gw(upstreams, store, tmp_path_factory):
    server = start_gateway(gateway_config(upstreams, store, tmp_path_factory.mktemp("state")))
    yield server
    server.stop()


def _oai(gw, key):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=20)


def _ant(gw, key):
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=20)


def _chat(client: openai.OpenAI, model: str = "gpt", text: str = "hi"):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}])


def _message(client: anthropic.Anthropic, model: str = "claude", text: str = "hi"):
    return client.messages.create(
        model=model, max_tokens=20, messages=[{"role": "user", "content": text}]
    )


def test_missing_key_is_401_in_each_wire_format(gw):
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "gpt", "messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(
        gw.url + "/v1/messages", json={"model": "claude", "max_tokens": 5, "messages": []}
    )
    assert r.status_code == 401 and r.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": r.json()["error"]["message"]},
    }
    assert "Authorization: Bearer" in r.json()["error"]["message"]


@pytest.mark.parametrize("key", ["fsk_wrong", MASTER_KEY + "x", "Bearer"])
def test_bad_key_is_401_in_each_wire_format(gw, key):
    with pytest.raises(openai.AuthenticationError) as oe:
        _chat(_oai(gw, key))
    assert oe.value.type == "authentication_error"
    assert oe.value.status_code == 401
    with pytest.raises(anthropic.AuthenticationError) as ae:
        _message(_ant(gw, key))
    assert ae.value.body["error"]["type"] == "authentication_error"


def test_master_key_and_created_keys_work_with_both_sdks(gw):
    assert _chat(_oai(gw, MASTER_KEY)).choices[0].message.content == "echo: hi"
    key = create_key(gw.url, name="both")["key"]
    assert _chat(_oai(gw, key)).choices[0].message.content == "echo: hi"
    assert _message(_ant(gw, key)).content[0].text == "echo: hi"  # sent as x-api-key


def test_key_is_shown_once_and_stored_hashed(gw, store):
    created = create_key(gw.url, name="secretive", models=["gpt"], rpm=5)
    secret = created["key"]
    assert secret.startswith("fsk_") and len(secret) > 40
    listed = httpx.get(gw.url + "/v1/keys", headers=auth_headers(MASTER_KEY)).json()["data"]
    mine = [k for k in listed if k["id"] == created["id"]]
    assert len(mine) == 1 and "key" not in mine[0] and secret not in str(listed)
    assert mine[0]["prefix"] == secret[:10] and mine[0]["models"] == ["gpt"] and mine[0]["rpm"] == 5
    rows = store.query("SELECT * FROM fs_api_keys WHERE id = ?", created["id"])
    assert rows and all(secret not in str(v) for v in rows[0])


def test_key_limited_to_its_models_gets_403(gw):
    key = create_key(gw.url, name="gpt-only", models=["gpt"])["key"]
    assert _chat(_oai(gw, key)).choices[0].message.content == "echo: hi"
    with pytest.raises(anthropic.PermissionDeniedError) as e:
        _message(_ant(gw, key))
    assert "may not use model 'claude'" in e.value.body["error"]["message"]
    with pytest.raises(openai.PermissionDeniedError):
        _chat(_oai(gw, key), model="claude")


def test_rpm_limit_gives_429_with_retry_after(gw):
    key = create_key(gw.url, name="rpm", rpm=3)["key"]
    client = _oai(gw, key)
    for _ in range(3):
        _chat(client)
    with pytest.raises(openai.RateLimitError) as e:
        _chat(client)
    retry_after = int(e.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 60
    with pytest.raises(anthropic.RateLimitError) as ae:
        _message(_ant(gw, key))
    assert ae.value.body["error"]["type"] == "rate_limit_error"
    # Another key has its own window.
    other = create_key(gw.url, name="rpm-other", rpm=3)["key"]
    assert _chat(_oai(gw, other)).choices[0].message.content == "echo: hi"


def test_tpm_limit_counts_tokens_used(gw):
    key = create_key(gw.url, name="tpm", tpm=10)["key"]
    client = _oai(gw, key)
    _chat(client, text="a fairly long prompt that uses more than ten tokens in total, surely")
    with pytest.raises(openai.RateLimitError) as e:
        _chat(client)
    assert int(e.value.response.headers["retry-after"]) >= 1


def test_streamed_tokens_count_toward_tpm(gw):
    key = create_key(gw.url, name="tpm-stream", tpm=10)["key"]
    client = _oai(gw, key)
    stream = client.chat.completions.create(
        model="gpt",
        stream=True,
        messages=[
            {"role": "user", "content": "one two three four five six seven eight nine ten eleven"}
        ],
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).startswith(
        "echo:"
    )
    with pytest.raises(openai.RateLimitError):
        _chat(client)


def test_expired_and_revoked_keys_are_refused(gw):
    expired = create_key(gw.url, name="brief", expires_in=1)
    ok = _chat(_oai(gw, expired["key"]))
    assert ok.choices[0].message.content == "echo: hi"
    time.sleep(1.2)
    with pytest.raises(openai.AuthenticationError, match="expired"):
        _chat(_oai(gw, expired["key"]))
    revoked = create_key(gw.url, name="soon-gone")
    r = httpx.delete(gw.url + f"/v1/keys/{revoked['id']}", headers=auth_headers(MASTER_KEY))
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    with pytest.raises(anthropic.AuthenticationError, match="revoked"):
        _message(_ant(gw, revoked["key"]))


def test_only_the_master_key_manages_keys(gw):
    key = create_key(gw.url, name="plain")["key"]
    for method, path in (("get", "/v1/keys"), ("post", "/v1/keys"), ("delete", "/v1/keys/key_x")):
        r = httpx.request(method, gw.url + path, json={"name": "x"}, headers=auth_headers(key))
        assert r.status_code == 403, r.text
        r = httpx.request(method, gw.url + path, json={"name": "x"})
        assert r.status_code == 401, r.text
    bad = [
        {"name": ""},
        {"name": "x", "rpm": 0},
        {"name": "x", "models": "gpt"},
        {"name": "x", "extra": 1},
    ]
    before = len(httpx.get(gw.url + "/v1/keys", headers=auth_headers(MASTER_KEY)).json()["data"])
    for body in bad:
        assert (
            httpx.post(gw.url + "/v1/keys", json=body, headers=auth_headers(MASTER_KEY)).status_code
            == 400
        )
    assert (
        len(httpx.get(gw.url + "/v1/keys", headers=auth_headers(MASTER_KEY)).json()["data"])
        == before
    )
    assert (
        httpx.delete(gw.url + "/v1/keys/key_nope", headers=auth_headers(MASTER_KEY)).status_code
        == 404
    )


def test_without_master_key_auth_is_off(upstreams, tmp_path):
    store = ScratchStore("sqlite", tmp_path)
    server = start_gateway(gateway_config(upstreams, store, tmp_path, master_key=None))
    try:
        assert _chat(_oai(server, "anything")).choices[0].message.content == "echo: hi"
        assert httpx.post(server.url + "/v1/sessions", json={}).status_code == 200
        r = httpx.get(server.url + "/v1/keys")
        assert r.status_code == 403 and "master_key" in r.json()["error"]["message"]
    finally:
        server.stop()
