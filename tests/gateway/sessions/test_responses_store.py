"""Stored Responses on both stores (SQLite file, PostgreSQL schema): a three-turn
previous_response_id chain across wires, another key's ids unseen, deletion."""

from __future__ import annotations

import openai
import pytest


def _client(gw, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=20)


def test_a_chain_is_stored_per_key(gw, key_a, key_b, upstreams):
    alice, bob = _client(gw, key_a), _client(gw, key_b)
    one = alice.responses.create(model="gpt", input="first")
    with alice.responses.stream(model="claude", input="second", previous_response_id=one.id) as s:
        two = s.get_final_response()
    three = alice.responses.create(model="gpt", input="third", previous_response_id=two.id)
    assert three.output_text == "echo: third"
    # the last chat request: the gateway's health probes (GET /v1/models) may come after it
    chats = [r for r in upstreams["openai"].requests if r.path == "/v1/chat/completions"]
    sent = chats[-1].body["messages"]
    assert [m["content"] for m in sent] == [
        "first",
        "echo: first",
        "second",
        "echo: second",
        "third",
    ]
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(three.id)
    assert [i.content[0].text for i in alice.responses.input_items.list(three.id).data] == ["third"]
    alice.responses.delete(one.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.create(model="gpt", input="again", previous_response_id=one.id)
    # the rest of the chain stays
    assert alice.responses.retrieve(two.id).previous_response_id == one.id
