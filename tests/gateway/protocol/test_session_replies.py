"""A stored reply goes back upstream in the session's next turn as the client received it: every
block of an Anthropic upstream's message (thinking with its signature, redacted thinking, text with
its citations, a server tool's blocks, tool use), whole; each test on SQLite and on PostgreSQL."""

from __future__ import annotations

import json

import httpx
import pytest

from flashstack.gateway.app import create_app
from tests.fakes.server import FakeServer
from tests.gateway.protocol import canned, samples
from tests.gateway.protocol.conftest import CLIENT_KEY, gateway_config
from tests.gateway.sessions.conftest import STORES
from tests.gateway.sessions.support import ScratchStore, pg_available

HEADERS = {"authorization": f"Bearer {CLIENT_KEY}", "anthropic-version": "2023-06-01"}
SERVER_BLOCKS = [
    {
        "type": "server_tool_use",
        "id": "srvtoolu_1",
        "name": "web_search",
        "input": {"query": "paris weather"},
    },
    {
        "type": "web_search_tool_result",
        "tool_use_id": "srvtoolu_1",
        "content": [
            {
                "type": "web_search_result",
                "url": "https://example.com",
                "title": "a",
                "encrypted_content": "Eo8B",
                "page_age": None,
            }
        ],
    },
]


@pytest.fixture(scope="module", params=STORES)
def session_gateway(request, canned_upstreams, tmp_path_factory, tiny_model):
    """The protocol gateway with its sessions in a fresh SQLite file or PostgreSQL schema."""
    if request.param == "postgres" and not pg_available():
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    store = ScratchStore(request.param, tmp_path_factory.mktemp(request.param))
    config = gateway_config(canned_upstreams, tmp_path_factory, tiny_model, store.config())
    server = FakeServer(create_app(config), lifespan="on").start()
    yield server
    server.stop()
    store.drop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_anthropic_reply_is_replayed_whole(session_gateway, upstream, stream):
    reply = samples.anthropic_response()
    reply["content"][2]["citations"] = samples.anthropic_messages()[1]["content"][2]["citations"]
    reply["content"][2:2] = SERVER_BLOCKS
    upstream["anthropic"].app.state.reply = canned.Reply(body=reply, events=_events(reply))
    with httpx.Client(base_url=session_gateway.url, headers=HEADERS, timeout=20) as c:
        r = c.post("/v1/sessions", json={"model": "claude"})
        assert r.status_code == 200, r.text
        sid = r.json()["id"]
        for word in ("first", "second"):
            body = {
                "model": "claude",
                "max_tokens": 64,
                "messages": [{"role": "user", "content": word}],
                "stream": stream and word == "first",
            }
            r = c.post("/v1/messages", headers={"x-session-id": sid}, json=body)
            assert r.status_code == 200, r.text
    sent = upstream["anthropic"].requests[-1].body["messages"]
    assert sent[1] == {"role": "assistant", "content": reply["content"]}


def _events(reply: dict) -> list[tuple[str, dict]]:
    """`reply` as the Messages API streams it: each block started empty, then its deltas."""
    start = {**reply, "content": [], "stop_reason": None}
    events = [("message_start", {"type": "message_start", "message": start})]
    for i, block in enumerate(reply["content"]):
        head, deltas = dict(block), []
        if block["type"] == "text":
            head["text"], head["citations"] = "", None
            deltas.append({"type": "text_delta", "text": block["text"]})
            deltas += [
                {"type": "citations_delta", "citation": c} for c in block.get("citations") or []
            ]
        elif block["type"] == "thinking":
            head["thinking"], head["signature"] = "", ""
            deltas += [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        elif block["type"] in ("tool_use", "server_tool_use"):
            head["input"] = {}
            deltas.append({"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        events.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": i, "content_block": head},
            )
        )
        events += [
            ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d})
            for d in deltas
        ]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    events += [
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reply["stop_reason"], "stop_sequence": None},
                "usage": reply["usage"],
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return events


def test_a_server_tools_blocks_stream_to_an_openai_client_named(protocol_gateway, upstream):
    reply = samples.anthropic_response()
    reply["content"][2:2] = (
        SERVER_BLOCKS  # their input streams as input_json_delta, yet is no tool call
    )
    upstream["anthropic"].app.state.reply = canned.Reply(body=reply, events=_events(reply))
    with httpx.stream(
        "POST",
        protocol_gateway.url + "/v1/chat/completions",
        headers=HEADERS,
        timeout=20,
        json={"model": "claude", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert not any("error" in c for c in chunks)
    calls = [
        tc
        for c in chunks
        if c["choices"]
        for tc in c["choices"][0]["delta"].get("tool_calls") or []
    ]
    assert [tc["function"]["name"] for tc in calls if tc.get("id")] == ["get_time"]
    final = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert {
        "response.content[].type=server_tool_use",
        "response.content[].type=web_search_tool_result",
    } <= set(final["flashstack_dropped"].split(","))


def test_an_idempotent_stream_replay_carries_every_block(session_gateway, upstream):
    reply = samples.anthropic_response()
    reply["content"][2]["citations"] = samples.anthropic_messages()[1]["content"][2]["citations"]
    reply["content"][2:2] = SERVER_BLOCKS
    upstream["anthropic"].app.state.reply = canned.Reply(body=reply, events=_events(reply))
    with httpx.Client(base_url=session_gateway.url, headers=HEADERS, timeout=20) as c:
        sid = c.post("/v1/sessions", json={"model": "claude"}).json()["id"]
        body = {
            "model": "claude",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
        }
        headers = {"x-session-id": sid, "idempotency-key": f"replay-{sid}"}
        first, again = (_streamed_blocks(c, body, headers) for _ in range(2))
    assert len(upstream["anthropic"].requests) == 1  # the retry was answered from the store
    assert first == _streamed_blocks_of(_events(reply))
    assert again == first


def _streamed_blocks(c: httpx.Client, body: dict, headers: dict) -> list[dict]:
    with c.stream("POST", "/v1/messages", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        events = [
            ("", json.loads(line[6:])) for line in r.iter_lines() if line.startswith("data: ")
        ]
    return _streamed_blocks_of(events)


def _streamed_blocks_of(events: list[tuple[str, dict]]) -> list[dict]:
    """The content blocks a client assembles from a Messages stream (as the SDK's
    accumulator does)."""
    blocks: dict[int, dict] = {}
    partial: dict[int, str] = {}
    for _, e in events:
        if e["type"] == "content_block_start":
            blocks[e["index"]] = dict(e["content_block"])
        elif e["type"] == "content_block_delta":
            b, d = blocks[e["index"]], e["delta"]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "citations_delta":
                b["citations"] = [*(b.get("citations") or []), d["citation"]]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] = d["signature"]
            elif d["type"] == "input_json_delta":
                partial[e["index"]] = partial.get(e["index"], "") + d["partial_json"]
    for i, text in partial.items():
        blocks[i]["input"] = json.loads(text or "{}")
    return [blocks[i] for i in sorted(blocks)]


OPENAI_REPLY_MESSAGE = {
    "role": "assistant",
    "content": "Sunny, says the web.",
    "refusal": None,
    "annotations": [
        {
            "type": "url_citation",
            "url_citation": {
                "url": "https://example.com",
                "title": "a",
                "start_index": 0,
                "end_index": 5,
            },
        }
    ],
    "audio": {"id": "audio_1", "expires_at": 1760003600, "data": "UklGRg", "transcript": "Sunny."},
    "x_message_future": {"kept": True},
    "tool_calls": [
        {
            "id": "call_9",
            "type": "function",
            "x_call_future": 1,
            "function": {"name": "get_time", "arguments": '{"tz": "CET"}'},
        }
    ],
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_openai_reply_is_replayed_whole(session_gateway, upstream, stream):
    reply = samples.openai_response()
    reply["choices"][0]["message"] = OPENAI_REPLY_MESSAGE
    upstream["openai"].app.state.reply = canned.Reply(
        body=reply, events=_openai_events(OPENAI_REPLY_MESSAGE)
    )
    with httpx.Client(base_url=session_gateway.url, headers=HEADERS, timeout=20) as c:
        sid = c.post("/v1/sessions", json={"model": "oai"}).json()["id"]
        for word in ("first", "second"):
            body = {
                "model": "oai",
                "messages": [{"role": "user", "content": word}],
                "stream": stream and word == "first",
            }
            r = c.post("/v1/chat/completions", headers={"x-session-id": sid}, json=body)
            assert r.status_code == 200, r.text
        sent = upstream["openai"].requests[-1].body["messages"]
        # Back upstream as a request message: the reply-only keys (annotations, unknown ones) stay
        # in the session, a request names the audio answer by its id, a tool call keeps its own.
        reply_only = {"annotations", "x_message_future"}
        assert sent[1] == {
            **{k: v for k, v in OPENAI_REPLY_MESSAGE.items() if k not in reply_only},
            "audio": {"id": "audio_1"},
        }
        # On the Messages wire the keys only OpenAI has are dropped, and named.
        upstream["anthropic"].app.state.reply = canned.Reply(body=samples.anthropic_response())
        body = {
            "model": "claude",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "third"}],
        }
        r = c.post("/v1/messages", headers={"x-session-id": sid}, json=body)
        assert r.status_code == 200, r.text
    assert "messages[].audio" in r.headers["x-flashstack-dropped"].split(",")
    crossed = upstream["anthropic"].requests[-1].body["messages"][1]
    assert crossed["role"] == "assistant" and "annotations" not in crossed


def _openai_events(message: dict) -> list[tuple[str, dict]]:
    """`message` as Chat Completions streams it: the role, the content in pieces, the other keys,
    then each tool call's head and its arguments in pieces."""
    base = {
        "id": "chatcmpl-s",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-upstream-1",
    }

    def chunk(delta: dict, finish: str | None = None) -> tuple[str, dict]:
        return "", {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    text = message["content"]
    events = [chunk({"role": "assistant", "content": "", "refusal": None})]
    events += [chunk({"content": text[i : i + 6]}) for i in range(0, len(text), 6)]
    rest = {
        k: v for k, v in message.items() if k not in ("role", "content", "refusal", "tool_calls")
    }
    events.append(chunk(rest))
    for k, call in enumerate(message["tool_calls"]):
        args = call["function"]["arguments"]
        head = {**call, "index": k, "function": {"name": call["function"]["name"], "arguments": ""}}
        events.append(chunk({"tool_calls": [head]}))
        events += [
            chunk({"tool_calls": [{"index": k, "function": {"arguments": args[i : i + 5]}}]})
            for i in range(0, len(args), 5)
        ]
    return [*events, chunk({}, "tool_calls")]


@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
def test_an_idempotent_openai_stream_replay_carries_every_key(
    session_gateway, upstream, include_usage
):
    reply = samples.openai_response()
    reply["choices"][0]["message"] = OPENAI_REPLY_MESSAGE
    events = _openai_events(OPENAI_REPLY_MESSAGE)
    upstream["openai"].app.state.reply = canned.Reply(body=reply, events=events)
    with httpx.Client(base_url=session_gateway.url, headers=HEADERS, timeout=20) as c:
        sid = c.post("/v1/sessions", json={"model": "oai"}).json()["id"]
        body = {"model": "oai", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        headers = {"x-session-id": sid, "idempotency-key": f"replay-{sid}"}
        sent = len(upstream["openai"].requests)
        first, again = (_streamed_chunks(c, body, headers) for _ in range(2))
    assert len(upstream["openai"].requests) == sent + 1  # the retry was answered from the store
    assert _streamed_message(first) == OPENAI_REPLY_MESSAGE
    assert _streamed_message(again) == _streamed_message(first)
    assert [c["choices"][0]["finish_reason"] for c in again if c["choices"]][-1] == "tool_calls"
    usages = [[c["usage"] for c in chunks if c.get("usage")] for chunks in (first, again)]
    assert usages[1] == usages[0] and len(usages[0]) == include_usage
    # The events carry no usage: the gateway counted, and the replay says so as the first reply did
    assert all(u["flashstack_estimate"] for u in usages[1])


def _streamed_chunks(c: httpx.Client, body: dict, headers: dict) -> list[dict]:
    with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _streamed_message(chunks: list[dict]) -> dict:
    """The message a client assembles from Chat Completions chunks: strings appended, lists
    extended, any other key as its last non-null value; tool calls by their index."""
    message: dict = {}
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = dict(choice["delta"])
            for call in delta.pop("tool_calls", None) or []:
                into = calls.setdefault(call["index"], {"function": {"arguments": ""}})
                fn = call.get("function", {})
                into["function"]["arguments"] += fn.get("arguments", "")
                into["function"].update({k: v for k, v in fn.items() if k != "arguments"})
                into.update({k: v for k, v in call.items() if k not in ("index", "function")})
            for k, v in delta.items():
                if isinstance(v, str) and isinstance(message.get(k), str) and k != "role":
                    message[k] += v
                elif isinstance(v, list) and isinstance(message.get(k), list):
                    message[k] += v
                elif v is not None or k not in message:
                    message[k] = v
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message
