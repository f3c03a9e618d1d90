"""Stored responses: previous_response_id chains, per-key visibility, GET / DELETE / input_items,
and a broken stream that stores nothing."""

from __future__ import annotations

import openai
import pytest


def test_a_chain_of_three_turns_sends_the_whole_conversation(client, upstream):
    one = client.responses.create(model="oai", input="first", instructions="Be brief.")
    two = client.responses.create(model="claude", input="second", previous_response_id=one.id)
    assert two.previous_response_id == one.id
    three = client.responses.create(model="oai", input="third", previous_response_id=two.id)
    assert three.output_text == "echo: third"
    assert upstream["openai"].requests[-1].body["messages"] == [  # instructions do not carry over
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "echo: first"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "echo: second"},
        {"role": "user", "content": "third"},
    ]
    assert upstream["anthropic"].requests[-1].body["messages"][0]["role"] == "user"


def test_a_streamed_response_is_stored_and_continued(client, upstream):
    with client.responses.stream(model="claude", input="streamed") as s:
        first = s.get_final_response()
    assert client.responses.retrieve(first.id).output_text == "echo: streamed"
    nxt = client.responses.create(model="oai", input="and then", previous_response_id=first.id)
    assert nxt.output_text == "echo: and then"
    assert upstream["openai"].requests[-1].body["messages"][1] == {
        "role": "assistant",
        "content": "echo: streamed",
    }


def test_a_tool_call_continues_from_the_stored_call(client, upstream):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {}},
        }
    ]
    first = client.responses.create(model="claude", input="weather?", tools=tools)
    call = first.output[0]
    nxt = client.responses.create(
        model="claude",
        tools=tools,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert nxt.output_text == "tool said: sunny"


def test_another_keys_response_is_not_found(client, other_client, upstream):
    mine = client.responses.create(model="oai", input="secret")
    for call in (
        lambda: other_client.responses.retrieve(mine.id),
        lambda: other_client.responses.delete(mine.id),
        lambda: other_client.responses.input_items.list(mine.id),
        lambda: other_client.responses.create(model="oai", input="x", previous_response_id=mine.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert client.responses.retrieve(mine.id).output_text == "echo: secret"


def test_get_input_items_and_delete(client, upstream):
    r = client.responses.create(
        model="oai",
        input=[
            {"role": "user", "content": "a"},
            {"role": "user", "content": [{"type": "input_text", "text": "b"}]},
        ],
    )
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    items = client.responses.input_items.list(r.id, order="asc")
    assert [(i.role, i.content[0].type, i.content[0].text) for i in items.data] == [
        ("user", "input_text", "a"),
        ("user", "input_text", "b"),
    ]
    assert all(i.id for i in items.data)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_store_false_keeps_nothing(client, upstream):
    r = client.responses.create(model="oai", input="ephemeral", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_a_stream_cut_midway_fails_and_stores_nothing(client, upstream):
    with client.responses.stream(model="claude", input="[[midstream_error]] go") as s:
        events = list(s)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"]
    assert "response.completed" not in kinds
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(events[0].response.id)
