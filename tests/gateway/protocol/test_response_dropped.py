"""Response fields the client's wire has no place for are named, `response.<field>`, in
x-flashstack-dropped (and, streamed across wires, complete in the final event's flashstack_dropped);
generated from the response tables in translate/fields.py."""

from __future__ import annotations

import json

import httpx
import pytest

from flashstack.gateway.translate import fields
from flashstack.gateway.translate.fields import Fate
from tests.gateway.protocol.conftest import CLIENT_KEY

BARE = {
    "openai": {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "a"}}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    },
    "anthropic": {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "a"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 1, "output_tokens": 1},
    },
}


def _with(body: dict, path: str, value) -> dict:
    """`body` with `value` at a row's path: `a.b`, `a[0].b`, `a[1:]`, `a[].b`, `a[].type=x`."""
    body = json.loads(json.dumps(body))
    steps = fields._PATH.findall(path)
    node = body
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        if step == "[]":
            node = node if "=" in steps[i + 1] else node[0]
        elif step.endswith(":]"):
            node.extend(value)
        elif step.startswith("["):
            node = node[int(step[1:-1])]
        elif "=" in step:
            key, _, want = step.partition("=")
            node.append({key: want, **value})
        elif last:
            node[step] = value
        else:
            node = node.setdefault(step, {})
    return body


def _rows(fate_filter) -> list:
    return [
        pytest.param(wire, row, id=f"{wire}:{row.name}")
        for wire, table in fields.RESPONSE_TABLES.items()
        for row in table
        if fate_filter(row)
    ]


@pytest.mark.parametrize("wire,row", _rows(lambda r: r.cross is Fate.DROPPED and r.named))
def test_a_dropped_response_field_is_named_when_the_upstream_sends_it(wire, row):
    assert row.sample is not None, f"{row.name}: a named dropped row needs a sample value"
    assert fields.dropped_response_fields(wire, BARE[wire]) == set()
    named = fields.dropped_response_fields(wire, _with(BARE[wire], row.name, row.sample))
    assert named == {"response." + row.name}


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_a_response_field_newer_than_the_table_is_named(wire):
    assert fields.dropped_response_fields(wire, {**BARE[wire], "x_new": {"a": 1}}) == {
        "response.x_new"
    }
    assert (
        fields.dropped_response_fields(wire, {**BARE[wire], "x_new": None}) == set()
    )  # carries nothing


def test_values_that_carry_nothing_are_not_named():
    body = _with(
        BARE["openai"],
        "usage.completion_tokens_details",
        {"reasoning_tokens": 0, "audio_tokens": 0},
    )
    body = _with(body, "choices[0].logprobs", None)
    assert (
        fields.dropped_response_fields("openai", {**body, "created": 1, "system_fingerprint": None})
        == set()
    )


HEADERS = {
    "authorization": f"Bearer {CLIENT_KEY}",
    "x-api-key": CLIENT_KEY,
    "anthropic-version": "2023-06-01",
}
HI = [{"role": "user", "content": "hi"}]
OPENAI_NAMES = {
    "response.system_fingerprint",
    "response.service_tier",
    "response.choices[0].logprobs",
    "response.usage.completion_tokens_details",
    "response.x_future_field",
    "response.choices[0].message.x_message_future",
}
ANTHROPIC_NAMES = {
    "response.content[].type=redacted_thinking",
    "response.usage.cache_creation",
    "response.usage.service_tier",
}


def _names(value: str | None) -> set[str]:
    return set(filter(None, (value or "").split(",")))


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_an_openai_upstreams_fields_to_an_anthropic_client_are_named(protocol_gateway, answered):
    r = httpx.post(
        protocol_gateway.url + "/v1/messages",
        headers=HEADERS,
        timeout=20,
        json={"model": "oai", "max_tokens": 64, "messages": HI},
    )
    assert r.status_code == 200, r.text
    assert _names(r.headers["x-flashstack-dropped"]) == OPENAI_NAMES
    assert fields.DROPPED_FIELD not in r.json()  # a whole body's header came after all of it


def test_an_openai_upstreams_stream_to_an_anthropic_client_names_them_by_its_end(
    protocol_gateway, answered
):
    with httpx.stream(
        "POST",
        protocol_gateway.url + "/v1/messages",
        headers=HEADERS,
        timeout=20,
        json={"model": "oai", "max_tokens": 64, "messages": HI, "stream": True},
    ) as r:
        head = _names(r.headers.get("x-flashstack-dropped"))
        events = _events(r.read().decode())
    # Known with the first content event: what every chunk carries, and that chunk's logprobs.
    assert {
        "response.system_fingerprint",
        "response.service_tier",
        "response.choices[0].logprobs",
    } <= head
    final = next(e for e in events if e["type"] == "message_delta")
    assert head <= _names(final[fields.DROPPED_FIELD])
    assert "response.usage.completion_tokens_details" in _names(
        final[fields.DROPPED_FIELD]
    )  # the last chunk's


def test_an_anthropic_upstreams_fields_to_an_openai_client_are_named(protocol_gateway, answered):
    r = httpx.post(
        protocol_gateway.url + "/v1/chat/completions",
        headers=HEADERS,
        timeout=20,
        json={"model": "claude", "messages": HI},
    )
    assert r.status_code == 200, r.text
    assert _names(r.headers["x-flashstack-dropped"]) == ANTHROPIC_NAMES
    with httpx.stream(
        "POST",
        protocol_gateway.url + "/v1/chat/completions",
        headers=HEADERS,
        timeout=20,
        json={"model": "claude", "messages": HI, "stream": True},
    ) as r:
        head = _names(r.headers.get("x-flashstack-dropped"))
        chunks = _events(r.read().decode())
    assert {
        "response.usage.cache_creation",
        "response.usage.service_tier",
    } <= head  # message_start's
    final = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert _names(final[fields.DROPPED_FIELD]) == ANTHROPIC_NAMES


@pytest.mark.parametrize(
    "wire,path,model",
    [("openai", "/v1/chat/completions", "oai"), ("anthropic", "/v1/messages", "claude")],
)
def test_the_same_wire_names_nothing_of_the_response(protocol_gateway, answered, wire, path, model):
    r = httpx.post(
        protocol_gateway.url + path,
        headers=HEADERS,
        timeout=20,
        json={"model": model, "max_tokens": 64, "messages": HI},
    )
    assert r.status_code == 200 and "x-flashstack-dropped" not in r.headers, r.text
