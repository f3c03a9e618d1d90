"""Issue 24, sessions: the message limit holds on the chat path too, the history sent upstream is
bounded, and a key cannot create sessions without end (rpm, and store.max_sessions_per_key)."""

from __future__ import annotations

import concurrent.futures
import uuid

import httpx
import orjson
import pytest

from tests.gateway.sessions.support import (
    MASTER_KEY,
    auth_headers,
    create_key,
    gateway_config,
    start_gateway,
)

MESSAGE_LIMIT = 64 * 1024
HISTORY_LIMIT = 200_000
SESSION_CAP = 3
ANTHROPIC = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def gw(upstreams, store, tmp_path_factory):
    config = gateway_config(
        upstreams,
        store,
        tmp_path_factory.mktemp("state"),
        max_message_bytes=MESSAGE_LIMIT,
        max_history_bytes=HISTORY_LIMIT,
        max_sessions_per_key=SESSION_CAP,
    )
    server = start_gateway(config)
    yield server
    server.stop()


def _session(gw, key: str, **body) -> httpx.Response:
    return httpx.post(gw.url + "/v1/sessions", json=body, headers=auth_headers(key), timeout=20)


def _turn(gw, key: str, session_id: str, content, wire: str = "openai") -> httpx.Response:
    headers = {**auth_headers(key), "X-Session-Id": session_id}
    if wire == "openai":
        body = {"model": "gpt", "messages": [{"role": "user", "content": content}]}
        return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=20)
    body = {"model": "claude", "max_tokens": 50, "messages": [{"role": "user", "content": content}]}
    return httpx.post(
        gw.url + "/v1/messages", json=body, headers={**headers, **ANTHROPIC}, timeout=20
    )


def _stored(store, session_id: str) -> int:
    return store.query("SELECT COUNT(*) FROM fs_messages WHERE session_id = ?", session_id)[0][0]


def _owned(store, owner: str) -> int:
    return store.query("SELECT COUNT(*) FROM fs_sessions WHERE owner = ?", owner)[0][0]


# ---- store.max_message_bytes on the chat path --------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        pytest.param("x" * (MESSAGE_LIMIT + 1), id="one-text"),
        pytest.param([{"type": "text", "text": "y" * (MESSAGE_LIMIT // 2)}] * 3, id="parts-summed"),
    ],
)
@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_oversized_message_via_session_header_is_413_and_stores_nothing(gw, store, content, wire):
    key = create_key(gw.url, name="big-talker")["key"]
    sid = _session(gw, key).json()["id"]
    r = _turn(gw, key, sid, content, wire)
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert (
        "store.max_message_bytes" in error["message"] and "nothing was stored" in error["message"]
    )
    if wire == "anthropic":
        assert r.json() == {
            "type": "error",
            "error": {"type": "request_too_large", "message": error["message"]},
        }
    else:
        assert error["type"] == "invalid_request_error" and error["param"] == "messages[0]"
    assert _stored(store, sid) == 0
    listed = httpx.get(gw.url + f"/v1/sessions/{sid}/messages", headers=auth_headers(key)).json()
    assert listed["data"] == []
    # The session is not left locked: a normal turn goes through at once, and is stored.
    r = _turn(gw, key, sid, "small", wire)
    assert r.status_code == 200, r.text
    assert _stored(store, sid) == 2


def test_message_at_the_limit_is_stored(gw, store):
    key = create_key(gw.url, name="at-the-limit")["key"]
    sid = _session(gw, key).json()["id"]
    stored_overhead = len(orjson.dumps([{"type": "text", "text": ""}]))
    text = ("ab " * MESSAGE_LIMIT)[: MESSAGE_LIMIT - stored_overhead]
    body = {"model": "gpt", "max_tokens": 2, "messages": [{"role": "user", "content": text}]}
    headers = {**auth_headers(key), "X-Session-Id": sid}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=20)
    # (a short reply: the echo of it all would be over the limit)
    assert r.status_code == 200, r.text
    assert _stored(store, sid) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_reply_over_the_limit_is_not_stored(gw, store, upstreams, stream):
    # A model that answers more than a session message may hold: an error in the caller's format,
    # the user's message kept as incomplete, and a stream cut off (its upstream
    # closed) at the limit.
    key = create_key(gw.url, name="big-answers")["key"]
    sid = _session(gw, key).json()["id"]
    marker = uuid.uuid4().hex[:8]
    body = {
        "model": "gpt",
        "stream": stream,
        "messages": [{"role": "user", "content": f"[[big:{8 * MESSAGE_LIMIT}]] {marker}"}],
    }
    headers = {**auth_headers(key), "X-Session-Id": sid}
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=20
    ) as r:
        raw = r.read()
    if stream:
        assert r.status_code == 200 and b"store.max_message_bytes" in raw and b"[DONE]" not in raw
        assert len(raw) < 3 * MESSAGE_LIMIT  # cut off near the limit, not relayed whole
    else:
        assert r.status_code == 502 and "store.max_message_bytes" in r.json()["error"]["message"]
    rows = store.query("SELECT role, status, error FROM fs_messages WHERE session_id = ?", sid)
    assert [(role, status) for role, status, _ in rows] == [("user", "incomplete")]
    assert "store.max_message_bytes" in rows[0][2]
    r = _turn(gw, key, sid, "short")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "echo: short"


# ---- the history sent upstream ------------------------------------------------------------------


def test_history_sent_upstream_is_bounded_and_whole_turns(gw, store, upstreams):
    key = create_key(gw.url, name="long-talker")["key"]
    sid = _session(gw, key).json()["id"]
    size = MESSAGE_LIMIT - 100
    # each turn stores ~2 × size (the fake echoes): 4 turns ≈ 2.6 × HISTORY_LIMIT
    for i in range(4):
        assert _turn(gw, key, sid, f"turn{i} " + "w" * size).status_code == 200
    marker = f"last-{uuid.uuid4().hex[:8]}"
    r = _turn(gw, key, sid, marker)
    assert (
        r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == f"echo: {marker}"
    )
    sent = next(q for q in reversed(upstreams["openai"].requests) if marker.encode() in q.raw)
    assert HISTORY_LIMIT // 2 < len(sent.raw) <= HISTORY_LIMIT + 2048
    messages = sent.body["messages"]
    texts = [
        m["content"] if isinstance(m["content"], str) else m["content"][0]["text"] for m in messages
    ]
    # The newest whole turn that fits, begun at its user message, then the new message.
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert (
        texts[0].startswith("turn3 ") and texts[1].startswith("echo: turn3 ") and texts[2] == marker
    )
    assert _stored(store, sid) == 10  # nothing stored was dropped
    assert _turn(gw, key, sid, "again").status_code == 200


def test_session_history_counts_toward_the_tpm_hold(gw, store):
    # The hold is taken once the history is known: a turn that drags a long history along is
    # estimated with it (here over the whole tpm, so it waits for an idle window), while the same
    # key's request without the session is admitted. The refused turn stores nothing.
    key = create_key(gw.url, name="tpm-history", tpm=2000)["key"]
    sid = _session(gw, key).json()["id"]
    headers = {**auth_headers(key), "X-Session-Id": sid}
    first = {
        "model": "gpt",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "w" * 6000}],
    }
    assert (
        httpx.post(gw.url + "/v1/chat/completions", json=first, headers=headers).status_code == 200
    )
    second = {"model": "gpt", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(gw.url + "/v1/chat/completions", json=second, headers=headers)
    assert r.status_code == 429 and "tokens" in r.json()["error"]["message"]
    assert _stored(store, sid) == 2
    r = httpx.post(gw.url + "/v1/chat/completions", json=second, headers=auth_headers(key))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "echo: hi"


# ---- how many sessions a key may create ---------------------------------------------------------


def test_session_cap_per_key_holds_under_concurrency(gw, store):
    created = create_key(gw.url, name="hoarder")
    key = created["key"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _session(gw, key), range(8)))
    assert sorted(r.status_code for r in results) == [200] * SESSION_CAP + [403] * (8 - SESSION_CAP)
    refused = next(r for r in results if r.status_code == 403).json()["error"]
    assert (
        refused["code"] == "session_limit_reached"
        and "store.max_sessions_per_key" in refused["message"]
    )
    assert _owned(store, created["id"]) == SESSION_CAP
    r = httpx.post(gw.url + "/v1/sessions", json={}, headers={**auth_headers(key), **ANTHROPIC})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert _owned(store, created["id"]) == SESSION_CAP
    # Deleting one makes room; the master key has no cap.
    first = next(r for r in results if r.status_code == 200).json()["id"]
    assert (
        httpx.delete(gw.url + f"/v1/sessions/{first}", headers=auth_headers(key)).status_code == 200
    )
    assert _session(gw, key).status_code == 200
    assert all(_session(gw, MASTER_KEY).status_code == 200 for _ in range(SESSION_CAP + 1))


def test_session_creation_counts_against_the_keys_rpm(gw, store):
    created = create_key(gw.url, name="rpm-sessions", rpm=2)
    key = created["key"]
    assert [_session(gw, key).status_code for _ in range(2)] == [200, 200]
    r = _session(gw, key)
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert _owned(store, created["id"]) == 2
    # The same budget as its chat requests; another key is untouched.
    body = {"model": "gpt", "messages": [{"role": "user", "content": "hi"}]}
    assert (
        httpx.post(
            gw.url + "/v1/chat/completions", json=body, headers=auth_headers(key)
        ).status_code
        == 429
    )
    other = create_key(gw.url, name="rpm-sessions-other", rpm=2)["key"]
    assert _session(gw, other).status_code == 200
