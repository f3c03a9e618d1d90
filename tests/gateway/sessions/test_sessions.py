"""Sessions end to end, on SQLite and on PostgreSQL: CRUD, turns, streams, history, idempotency,
serialized concurrent turns, and failures that keep only whole turns."""

from __future__ import annotations

import asyncio
import json
import uuid

import anthropic
import httpx
import openai
import pytest

from tests.gateway.sessions.support import auth_headers


def _client(gw, key):
    return httpx.Client(base_url=gw.url, headers=auth_headers(key), timeout=30)


def _new_session(c: httpx.Client, **body) -> dict:
    r = c.post("/v1/sessions", json={"model": "gpt", **body})
    assert r.status_code == 200, r.text
    return r.json()


def _messages(c: httpx.Client, sid: str) -> list[dict]:
    r = c.get(f"/v1/sessions/{sid}/messages", params={"limit": 100})
    assert r.status_code == 200, r.text
    return r.json()["data"]


def _texts(items: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], "".join(p.get("text", "") for p in m["content"])) for m in items]


def _counts(store) -> tuple[int, int]:
    return tuple(
        store.query(f"SELECT COUNT(*) FROM {t}")[0][0] for t in ("fs_sessions", "fs_messages")
    )


def _upstream_bodies(upstreams, marker: str) -> list[dict]:
    """Bodies the fake OpenAI upstream got whose last message mentions `marker`."""
    out = []
    for r in upstreams["openai"].requests:
        msgs = (r.body or {}).get("messages") or []
        if msgs and marker in json.dumps(msgs[-1]):
            out.append(r.body)
    return out


def test_session_lifecycle(gw, key_a):
    with _client(gw, key_a) as c:
        s = _new_session(c, metadata={"topic": "tests"}, system="Be brief.")
        assert s["id"].startswith("sess_") and s["object"] == "session"
        assert s["metadata"] == {"topic": "tests"} and isinstance(s["created_at"], int)
        assert c.get(f"/v1/sessions/{s['id']}").json() == s
        updated = c.post(f"/v1/sessions/{s['id']}", json={"metadata": {"topic": "changed"}}).json()
        assert updated["metadata"] == {"topic": "changed"}
        r = c.delete(f"/v1/sessions/{s['id']}")
        assert r.json() == {"id": s["id"], "object": "session.deleted", "deleted": True}
        assert c.get(f"/v1/sessions/{s['id']}").status_code == 404


def test_list_sessions_cursor_pagination(gw, master):
    # A key of its own, so other tests' sessions do not show up in its list.
    from tests.gateway.sessions.support import create_key

    key = create_key(gw.url, name="lister")["key"]
    with _client(gw, key) as c:
        ids = [_new_session(c)["id"] for _ in range(5)]
        seen, after = [], None
        while True:
            params = {"limit": 2, "order": "asc", **({"after": after} if after else {})}
            page = c.get("/v1/sessions", params=params).json()
            assert page["object"] == "list" and len(page["data"]) <= 2
            seen += [s["id"] for s in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert seen == ids
        desc = c.get("/v1/sessions", params={"limit": 100}).json()["data"]
        assert [s["id"] for s in desc] == ids[::-1]


def test_turns_keep_history_and_system(gw, key_a, upstreams):
    with _client(gw, key_a) as c:
        s = _new_session(c, system="You are terse.")
        marker = uuid.uuid4().hex[:8]
        first = c.post(f"/v1/sessions/{s['id']}/messages", json={"content": f"hello {marker}"})
        assert first.status_code == 200, first.text
        reply = first.json()
        assert reply["role"] == "assistant" and reply["status"] == "completed"
        assert reply["content"] == [{"type": "text", "text": f"echo: hello {marker}"}]
        second = c.post(
            f"/v1/sessions/{s['id']}/messages", json={"content": f"again {marker}"}
        ).json()
        assert second["content"][0]["text"] == f"echo: again {marker}"
        # The model saw the whole session: system, the first turn, then the new message.
        body = _upstream_bodies(upstreams, f"again {marker}")[-1]
        assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
        assert body["messages"][0]["content"] == "You are terse."
        items = _messages(c, s["id"])
        assert _texts(items) == [
            ("user", f"hello {marker}"),
            ("assistant", f"echo: hello {marker}"),
            ("user", f"again {marker}"),
            ("assistant", f"echo: again {marker}"),
        ]
        assert items[0]["turn_id"] == items[1]["turn_id"] != items[2]["turn_id"]


def test_message_pagination(gw, key_a):
    with _client(gw, key_a) as c:
        s = _new_session(c)
        for i in range(3):
            assert (
                c.post(f"/v1/sessions/{s['id']}/messages", json={"content": f"m{i}"}).status_code
                == 200
            )
        everything = _messages(c, s["id"])
        assert len(everything) == 6
        page = c.get(f"/v1/sessions/{s['id']}/messages", params={"limit": 4}).json()
        assert (
            page["has_more"]
            and page["first_id"] == everything[0]["id"]
            and page["last_id"] == everything[3]["id"]
        )
        rest = c.get(
            f"/v1/sessions/{s['id']}/messages", params={"limit": 4, "after": page["last_id"]}
        ).json()
        assert [m["id"] for m in rest["data"]] == [m["id"] for m in everything[4:]] and not rest[
            "has_more"
        ]
        desc = c.get(
            f"/v1/sessions/{s['id']}/messages",
            params={"order": "desc", "limit": 2, "after": everything[3]["id"]},
        ).json()
        assert [m["id"] for m in desc["data"]] == [everything[2]["id"], everything[1]["id"]]


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_streamed_session_message(gw, key_a, wire):
    # Anthropic's format for a caller that says anthropic-version; asking by Accept works too.
    headers = (
        {"anthropic-version": "2023-06-01", "accept": "text/event-stream"}
        if wire == "anthropic"
        else {}
    )
    body = (
        {"content": "stream me please"}
        if wire == "anthropic"
        else {"content": "stream me please", "stream": True}
    )
    with _client(gw, key_a) as c:
        s = _new_session(c, model="claude" if wire == "anthropic" else "gpt")
        with c.stream("POST", f"/v1/sessions/{s['id']}/messages", headers=headers, json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream"
            )
            raw = r.read().decode()
        assert (
            ("message_stop" in raw)
            if wire == "anthropic"
            else raw.rstrip().endswith("data: [DONE]")
        )
        assert _texts(_messages(c, s["id"])) == [
            ("user", "stream me please"),
            ("assistant", "echo: stream me please"),
        ]


def test_openai_sdk_joins_session_by_header(gw, key_a, upstreams):
    with _client(gw, key_a) as c:
        s = _new_session(c)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key_a, max_retries=0)
    marker = uuid.uuid4().hex[:8]
    for word in ("one", "two"):
        out = client.chat.completions.create(
            model="gpt",
            messages=[{"role": "user", "content": f"{word} {marker}"}],
            extra_headers={"X-Session-Id": s["id"]},
        )
        assert out.choices[0].message.content == f"echo: {word} {marker}"
    stream = client.chat.completions.create(
        model="gpt",
        messages=[{"role": "user", "content": f"three {marker}"}],
        stream=True,
        extra_headers={"X-Session-Id": s["id"]},
    )
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        == f"echo: three {marker}"
    )
    body = _upstream_bodies(upstreams, f"three {marker}")[-1]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant"] * 2 + ["user"]
    with _client(gw, key_a) as c:
        assert [t for _, t in _texts(_messages(c, s["id"]))] == [
            f"one {marker}",
            f"echo: one {marker}",
            f"two {marker}",
            f"echo: two {marker}",
            f"three {marker}",
            f"echo: three {marker}",
        ]


def test_anthropic_sdk_joins_session_by_metadata(gw, key_a):
    with _client(gw, key_a) as c:
        s = _new_session(c, model="claude")
    client = anthropic.Anthropic(base_url=gw.url, api_key=key_a, max_retries=0)
    for word in ("alpha", "beta"):
        out = client.messages.create(
            model="claude",
            max_tokens=50,
            messages=[{"role": "user", "content": word}],
            metadata={"session_id": s["id"]},  # type: ignore[typeddict-unknown-key]
        )
        assert out.content[0].text == f"echo: {word}"
    with client.messages.stream(
        model="claude",
        max_tokens=50,
        messages=[{"role": "user", "content": "gamma"}],
        extra_headers={"X-Session-Id": s["id"]},
    ) as stream:
        assert stream.get_final_message().content[0].text == "echo: gamma"
    with _client(gw, key_a) as c:
        assert [t for _, t in _texts(_messages(c, s["id"]))] == [
            "alpha",
            "echo: alpha",
            "beta",
            "echo: beta",
            "gamma",
            "echo: gamma",
        ]


def test_midstream_error_keeps_user_message_not_half_a_reply(gw, key_a, upstreams):
    with _client(gw, key_a) as c:
        s = _new_session(c)
        assert (
            c.post(f"/v1/sessions/{s['id']}/messages", json={"content": "before"}).status_code
            == 200
        )
        with c.stream(
            "POST",
            f"/v1/sessions/{s['id']}/messages",
            json={"content": "break [[midstream_error]]", "stream": True},
        ) as r:
            raw = r.read().decode()
        assert '"error"' in raw and "[DONE]" not in raw
        items = _messages(c, s["id"])
        assert [(m["role"], m["status"]) for m in items] == [
            ("user", "completed"),
            ("assistant", "completed"),
            ("user", "incomplete"),
        ]
        assert items[-1]["error"]["message"]
        # The failed message is kept but not replayed: the next turn sees only whole turns.
        marker = uuid.uuid4().hex[:8]
        assert (
            c.post(
                f"/v1/sessions/{s['id']}/messages", json={"content": f"after {marker}"}
            ).status_code
            == 200
        )
        body = _upstream_bodies(upstreams, f"after {marker}")[-1]
        assert [m["content"] for m in body["messages"]] == [
            "before",
            "echo: before",
            f"after {marker}",
        ]


def test_upstream_failure_records_error_and_returns_it(gw, key_a):
    with _client(gw, key_a) as c:
        s = _new_session(c)
        r = c.post(f"/v1/sessions/{s['id']}/messages", json={"content": "[[status:400]]"})
        assert r.status_code == 400 and r.json()["error"]["message"]
        items = _messages(c, s["id"])
        assert [(m["role"], m["status"]) for m in items] == [("user", "incomplete")]


def test_client_disconnect_mid_stream_releases_session(gw, key_a):
    with _client(gw, key_a) as c:
        s = _new_session(c)
        with c.stream(
            "POST",
            f"/v1/sessions/{s['id']}/messages",
            json={"content": "[[slow:0.05]]", "stream": True},
        ) as r:
            for line in r.iter_lines():
                if "tick 2" in line:
                    break  # leave mid-stream
        # The session is free again at once (not after the lease TTL) and holds no half reply.
        r = c.post(f"/v1/sessions/{s['id']}/messages", json={"content": "next"}, timeout=4)
        assert r.status_code == 200, r.text
        items = _messages(c, s["id"])
        assert [(m["role"], m["status"]) for m in items] == [
            ("user", "incomplete"),
            ("user", "completed"),
            ("assistant", "completed"),
        ]
        assert items[0]["error"]["type"] == "interrupted"


def test_idempotency_key_replays_without_a_second_turn(gw, key_a, upstreams):
    with _client(gw, key_a) as c:
        s = _new_session(c)
        marker = uuid.uuid4().hex
        body = {"content": f"once {marker}"}
        headers = {"Idempotency-Key": marker}
        first = c.post(f"/v1/sessions/{s['id']}/messages", json=body, headers=headers)
        again = c.post(f"/v1/sessions/{s['id']}/messages", json=body, headers=headers)
        assert first.status_code == again.status_code == 200
        assert first.json() == again.json()
        assert len(_upstream_bodies(upstreams, marker)) == 1
        # A stream retried with the same key replays the stored reply as a stream.
        sbody, sheaders = (
            {"content": f"streamed {marker}", "stream": True},
            {"Idempotency-Key": marker + "-s"},
        )
        raws = [
            c.post(f"/v1/sessions/{s['id']}/messages", json=sbody, headers=sheaders).text
            for _ in range(2)
        ]
        for raw in raws:
            chunks = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
            assert (
                "".join(
                    ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]
                )
                == f"echo: streamed {marker}"
            )
        assert len(_upstream_bodies(upstreams, f"streamed {marker}")) == 1
        # The chat endpoint in a session, through the OpenAI SDK: the retry gets the same answer.
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key_a, max_retries=0)
        kwargs = dict(
            model="gpt",
            messages=[{"role": "user", "content": f"chat {marker}"}],
            extra_headers={"X-Session-Id": s["id"], "Idempotency-Key": marker + "-chat"},
        )
        answers = [
            client.chat.completions.create(**kwargs).choices[0].message.content for _ in range(2)
        ]
        assert answers == [f"echo: chat {marker}"] * 2
        assert len(_upstream_bodies(upstreams, f"chat {marker}")) == 1
        before = _messages(c, s["id"])
        reused = c.post(
            f"/v1/sessions/{s['id']}/messages", json={"content": "different"}, headers=headers
        )
        assert (
            reused.status_code == 422 and reused.json()["error"]["code"] == "idempotency_key_reused"
        )
        assert _messages(c, s["id"]) == before
        assert len(before) == 6


def test_concurrent_posts_to_one_session_are_serialized(gw, key_a, upstreams):
    with _client(gw, key_a) as c:
        s = _new_session(c)
    marker, n = uuid.uuid4().hex[:8], 10

    async def post(i: int, ac: httpx.AsyncClient) -> int:
        r = await ac.post(
            f"/v1/sessions/{s['id']}/messages",
            json={"content": f"c{i} {marker}", "stream": i % 2 == 0},
        )
        await r.aread()
        return r.status_code

    async def main() -> list[int]:
        async with httpx.AsyncClient(
            base_url=gw.url, headers=auth_headers(key_a), timeout=60
        ) as ac:
            return await asyncio.gather(*(post(i, ac) for i in range(n)))

    assert asyncio.run(main()) == [200] * n
    with _client(gw, key_a) as c:
        items = _messages(c, s["id"])
    assert len(items) == 2 * n
    for user, assistant in zip(items[::2], items[1::2]):
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert user["turn_id"] == assistant["turn_id"]
        assert _texts([assistant])[0][1] == "echo: " + _texts([user])[0][1]
    # Each turn ran on the whole history before it: 1, 3, 5, ... messages reached the model.
    sizes = sorted(len(b["messages"]) for b in _upstream_bodies(upstreams, marker))
    assert sizes == [2 * i + 1 for i in range(n)]


def test_sessions_belong_to_their_key(gw, key_a, key_b):
    with _client(gw, key_a) as a, _client(gw, key_b) as b:
        s = _new_session(a)
        assert (
            a.post(f"/v1/sessions/{s['id']}/messages", json={"content": "mine"}).status_code == 200
        )
        before = _messages(a, s["id"])
        for r in (
            b.get(f"/v1/sessions/{s['id']}"),
            b.post(f"/v1/sessions/{s['id']}", json={"metadata": {"x": "y"}}),
            b.get(f"/v1/sessions/{s['id']}/messages"),
            b.post(f"/v1/sessions/{s['id']}/messages", json={"content": "theirs"}),
            b.delete(f"/v1/sessions/{s['id']}"),
            b.post(
                "/v1/chat/completions",
                headers={"X-Session-Id": s["id"]},
                json={"model": "gpt", "messages": [{"role": "user", "content": "theirs"}]},
            ),
        ):
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "session_not_found"
        assert s["id"] not in [
            x["id"] for x in b.get("/v1/sessions", params={"limit": 100}).json()["data"]
        ]
        assert _messages(a, s["id"]) == before
        assert a.get(f"/v1/sessions/{s['id']}").json()["metadata"] == {}
    client = anthropic.Anthropic(base_url=gw.url, api_key=key_b, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="claude",
            max_tokens=10,
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"X-Session-Id": s["id"]},
        )


@pytest.mark.parametrize(
    ("method", "path", "body", "params", "status"),
    [
        ("post", "/v1/sessions/sess_nope/messages", {"content": "hi"}, None, 404),
        ("get", "/v1/sessions/sess_nope/messages", None, None, 404),
        ("get", "/v1/sessions/{sid}/messages", None, {"after": "garbage"}, 400),
        (
            "get",
            "/v1/sessions/{sid}/messages",
            None,
            {"after": "msg_00000000000000000000000000000000"},
            400,
        ),
        ("get", "/v1/sessions/{sid}/messages", None, {"limit": "0"}, 400),
        ("get", "/v1/sessions/{sid}/messages", None, {"limit": "101"}, 400),
        ("get", "/v1/sessions/{sid}/messages", None, {"limit": "ten"}, 400),
        ("get", "/v1/sessions/{sid}/messages", None, {"order": "sideways"}, 400),
        ("get", "/v1/sessions", None, {"after": "sess_unknown"}, 400),
        ("post", "/v1/sessions/{sid}/messages", {"content": "x" * (1024 * 1024 + 1)}, None, 413),
        ("post", "/v1/sessions/{sid}/messages", {"content": ""}, None, 400),
        ("post", "/v1/sessions/{sid}/messages", {"content": 5}, None, 400),
        ("post", "/v1/sessions/{sid}/messages", {"content": "hi", "model": "nope"}, None, 404),
        ("post", "/v1/sessions/{sid}/messages", {"content": "hi", "surprise": 1}, None, 400),
        ("post", "/v1/sessions/{sid}", {"metadata": {"k": 5}}, None, 400),
        ("post", "/v1/sessions/{sid}", {"metadata": {f"k{i}": "v" for i in range(17)}}, None, 400),
        ("post", "/v1/sessions", {"model": "nope"}, None, 404),
        ("post", "/v1/sessions", {"metadata": "not an object"}, None, 400),
    ],
)
def test_bad_input_changes_nothing(gw, key_a, store, method, path, body, params, status):
    with _client(gw, key_a) as c:
        s = _new_session(c, metadata={"keep": "me"})
        assert (
            c.post(f"/v1/sessions/{s['id']}/messages", json={"content": "kept"}).status_code == 200
        )
        before = _counts(store)
        r = c.request(method, path.format(sid=s["id"]), json=body, params=params)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and err["type"].endswith("_error")
        assert _counts(store) == before
        assert c.get(f"/v1/sessions/{s['id']}").json()["metadata"] == {"keep": "me"}


def test_bad_key_gets_401_and_changes_nothing(gw, key_a, store):
    with _client(gw, key_a) as c:
        s = _new_session(c)
    before = store.query("SELECT COUNT(*) FROM fs_messages")[0][0]
    for key in (None, "fsk_not-a-real-key"):
        with _client(gw, key) as bad:
            for r in (
                bad.post(f"/v1/sessions/{s['id']}/messages", json={"content": "hi"}),
                bad.get(f"/v1/sessions/{s['id']}"),
                bad.post("/v1/sessions", json={}),
            ):
                assert r.status_code == 401
                assert r.json()["error"]["type"] == "authentication_error"
    assert store.query("SELECT COUNT(*) FROM fs_messages")[0][0] == before
