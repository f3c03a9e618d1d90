"""A session's history goes back upstream as the client sent it: every block, marker and extra field
(cache_control, thinking signatures, documents, tool blocks, unknown keys), string or list content,
on both wires, streamed or not, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from flashstack.gateway.translate.fields import PDF_B64, PNG
from tests.gateway.sessions.support import auth_headers

CACHED = {"type": "ephemeral"}


def _session(gw, key: str, model: str) -> str:
    r = httpx.post(gw.url + "/v1/sessions", json={"model": model}, headers=auth_headers(key))
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _sent(upstream, marker: str) -> dict:
    """The last body the upstream got whose last message mentions `marker`."""
    bodies = [
        r.body
        for r in upstream.requests
        if marker in json.dumps((r.body or {}).get("messages", [])[-1:])
    ]
    assert bodies, f"the upstream never got {marker!r}"
    return bodies[-1]


def _post(gw, key: str, path: str, sid: str, body: dict) -> httpx.Response:
    headers = {**auth_headers(key), "x-session-id": sid, "anthropic-version": "2023-06-01"}
    return httpx.post(gw.url + path, json=body, headers=headers, timeout=30)


def _streamed(gw, key: str, path: str, sid: str, body: dict) -> str:
    headers = {**auth_headers(key), "x-session-id": sid, "anthropic-version": "2023-06-01"}
    with httpx.stream(
        "POST", gw.url + path, json={**body, "stream": True}, headers=headers, timeout=30
    ) as r:
        assert r.status_code == 200, r.read()
        return r.read().decode()


def _anthropic_turn(marker: str) -> list[dict]:
    use = {
        "type": "tool_use",
        "id": "toolu_1",
        "name": "get_weather",
        "input": {"city": "Paris"},
        "cache_control": CACHED,
    }
    return [
        {
            "role": "user",
            "content": [
                {
                    "type": "document",
                    "source": {"type": "base64", "media_type": "application/pdf", "data": PDF_B64},
                    "title": "a.pdf",
                    "cache_control": CACHED,
                },
                {
                    "type": "text",
                    "text": f"hello {marker}",
                    "cache_control": {"type": "ephemeral", "ttl": "1h"},
                    "future_field": {"a": 1},
                },
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": PNG},
                    "cache_control": CACHED,
                },
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Hm.", "signature": "EqQBsig"},
                {"type": "redacted_thinking", "data": "EmwKAhgB"},
                {"type": "text", "text": "Let me look.", "citations": None},
                use,
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "cache_control": CACHED,
                    "content": [{"type": "text", "text": "18 C", "cache_control": CACHED}],
                },
                {"type": "text", "text": f"thanks {marker}"},
            ],
        },
    ]


def _openai_turn(marker: str) -> list[dict]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    return [
        {
            "role": "user",
            "name": "ada",
            "content": [
                {"type": "text", "text": f"hello {marker}", "cache_control": CACHED},
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64," + PNG, "detail": "low"},
                },
            ],
        },
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C"}]},
        {"role": "user", "content": [{"type": "text", "text": f"thanks {marker}"}]},
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_anthropic_history_replays_every_block_whole(gw, key_a, upstreams, stream):
    sid, marker = _session(gw, key_a, "claude"), uuid.uuid4().hex[:8]
    first = {"model": "claude", "max_tokens": 50, "messages": _anthropic_turn(marker)}
    if stream:
        _streamed(gw, key_a, "/v1/messages", sid, first)
    else:
        assert _post(gw, key_a, "/v1/messages", sid, first).status_code == 200
    reply = _sent(upstreams["anthropic"], f"thanks {marker}")
    assert reply["messages"] == first["messages"]  # the first turn itself went whole
    again = {
        "model": "claude",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": f"again {marker}"}],
    }
    r = _post(gw, key_a, "/v1/messages", sid, again)
    assert r.status_code == 200, r.text
    replayed = _sent(upstreams["anthropic"], f"again {marker}")["messages"]
    assert replayed[:3] == first["messages"]
    # The fake answers a turn that ends in a tool result with "tool said: …"; as blocks, as it came.
    assert replayed[3] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "tool said: 18 C"}],
    }
    assert replayed[4] == again["messages"][0]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_openai_history_replays_every_part_whole(gw, key_a, upstreams, stream):
    sid, marker = _session(gw, key_a, "gpt"), uuid.uuid4().hex[:8]
    first = {"model": "gpt", "messages": _openai_turn(marker)}
    if stream:
        _streamed(gw, key_a, "/v1/chat/completions", sid, first)
    else:
        assert _post(gw, key_a, "/v1/chat/completions", sid, first).status_code == 200
    again = {"model": "gpt", "messages": [{"role": "user", "content": f"again {marker}"}]}
    r = _post(gw, key_a, "/v1/chat/completions", sid, again)
    assert r.status_code == 200, r.text
    replayed = _sent(upstreams["openai"], f"again {marker}")["messages"]
    assert replayed[:4] == first["messages"]
    # The reply with every key a request message takes: the fake's `annotations` are reply-only.
    assert replayed[4] == {"role": "assistant", "content": "tool said: 18 C", "refusal": None}
    assert replayed[5] == again["messages"][0]


def test_history_of_the_other_wire_keeps_its_blocks_and_names_its_extras(gw, key_a, upstreams):
    # One session, used first from the OpenAI wire then from the Anthropic one: the OpenAI-only
    # fields (a participant name, an image's detail) cannot go to Anthropic, and say so.
    sid, marker = _session(gw, key_a, "gpt"), uuid.uuid4().hex[:8]
    assert (
        _post(
            gw,
            key_a,
            "/v1/chat/completions",
            sid,
            {"model": "gpt", "messages": _openai_turn(marker)},
        ).status_code
        == 200
    )
    r = _post(
        gw,
        key_a,
        "/v1/messages",
        sid,
        {
            "model": "claude",
            "max_tokens": 50,
            "messages": [{"role": "user", "content": f"again {marker}"}],
        },
    )
    assert r.status_code == 200, r.text
    assert {"messages[].name", "messages[].content[].image_url.detail"} <= set(
        r.headers["x-flashstack-dropped"].split(",")
    )
    replayed = _sent(upstreams["anthropic"], f"again {marker}")["messages"]
    first = replayed[0]["content"]
    assert first[0] == {"type": "text", "text": f"hello {marker}", "cache_control": CACHED}
    assert first[1]["type"] == "image" and "image_url" not in first[1]
    assert "name" not in replayed[0]


def test_anthropic_history_to_the_openai_wire_names_what_it_cannot_carry(gw, key_a, upstreams):
    sid, marker = _session(gw, key_a, "claude"), uuid.uuid4().hex[:8]
    turn = _anthropic_turn(marker)
    turn[0]["content"] = [
        b for b in turn[0]["content"] if b["type"] != "document"
    ]  # a PDF maps to a file part
    first = {"model": "claude", "max_tokens": 50, "messages": turn}
    assert _post(gw, key_a, "/v1/messages", sid, first).status_code == 200
    r = _post(
        gw,
        key_a,
        "/v1/chat/completions",
        sid,
        {"model": "gpt", "messages": [{"role": "user", "content": f"again {marker}"}]},
    )
    assert r.status_code == 200, r.text
    dropped = set(r.headers["x-flashstack-dropped"].split(","))
    assert {
        "messages[].content[].cache_control",
        "messages[].content[].future_field",
        "messages[].content[].type=thinking",
        "messages[].content[].type=redacted_thinking",
    } <= dropped
    sent = json.dumps(_sent(upstreams["openai"], f"again {marker}")["messages"])
    assert "cache_control" not in sent and "future_field" not in sent and "EqQBsig" not in sent
